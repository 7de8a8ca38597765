"""A real S3-compatible server for the object-storage tests, started and stopped by them: moto's server on
127.0.0.1, with IAM authentication on, reached through a TCP relay on 127.0.0.1 that a test can cut.

- Every request is signed and checked: the writer's keys may do anything, the reader's only read and list, so a
  write that the bucket refuses is the server's own ``AccessDenied``.
- The relay stands for the network between the ranks and the store. ``cut()`` closes its connections and refuses
  new ones (what a node sees when the network goes); ``mend()`` takes connections again. The server, and what it
  holds, stays up, so a test can look at what a save cut off midway left behind.
- Clients are configured as a user would configure fsspec (``fsspec.config.conf`` or ``FSSPEC_S3_*`` variables):
  endpoint, keys, and bounded timeouts and retries, so that a cut network fails a save in seconds.
"""
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Dict, List, Optional

from support.rank_server import free_port

HOST = "127.0.0.1"  # the server, the relay and every client: this machine's loopback interface only
REGION = "us-east-1"
START_TIMEOUT_S = 60
# the setup requests made before authentication starts: the writer, its policy and its access key
_UNAUTHENTICATED_SETUP = 3


class Relay:
    """A TCP relay from a port of its own to the server's, in threads of this process."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._connections: List[socket.socket] = []
        self._lock = threading.Lock()
        self._listener: Optional[socket.socket] = None
        self.mend()
        # a connection to the control port cuts the network, then is closed (support/faults.py's cut_network)
        self._control = socket.create_server((HOST, 0))
        self.control_port = self._control.getsockname()[1]
        threading.Thread(target=self._serve_control, daemon=True).start()

    def _serve_control(self) -> None:
        while True:
            try:
                caller, _ = self._control.accept()
            except OSError:
                return
            self.cut()
            caller.close()

    def mend(self) -> None:
        listener = socket.create_server((HOST, self.port))
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        """Refuse new connections and reset the open ones."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        with self._lock:
            for connection in self._connections:
                try:
                    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    connection.close()
                except OSError:
                    pass
            self._connections.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by cut()
            try:
                server = socket.create_connection((HOST, self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self._connections += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        try:
            while True:
                data = source.recv(1 << 16)
                if not data:
                    break
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class S3Server:
    """moto's server as a child process; ``stop()`` ends it. ``writer``/``reader``: access keys."""

    def __init__(self, log_path: str) -> None:
        port = free_port()
        environment = dict(os.environ, INITIAL_NO_AUTH_ACTION_COUNT=str(_UNAUTHENTICATED_SETUP))
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)],
            stdout=self._log, stderr=subprocess.STDOUT, env=environment,
        )
        self.server_endpoint = f"http://{HOST}:{port}"
        self.buckets: List[str] = []
        try:
            self._wait_until_up()
            self.writer = self._setup_writer()
            self.reader = self._make_user("reader", ["s3:GetObject", "s3:ListBucket", "s3:HeadObject"])
        except BaseException:
            self.stop()
            raise
        self.relay = Relay(port)
        self.endpoint = f"http://{HOST}:{self.relay.port}"

    def _wait_until_up(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the S3 server exited with {self.process.returncode}; see {self._log.name}")
            try:
                urllib.request.urlopen(f"{self.server_endpoint}/moto-api/data.json", timeout=2).read()
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"the S3 server did not answer within {START_TIMEOUT_S} s; see {self._log.name}")

    def _client(self, service: str, keys: Dict[str, str], endpoint: Optional[str] = None):
        import boto3
        import botocore.config

        return boto3.client(
            service, endpoint_url=endpoint or self.server_endpoint, region_name=REGION,
            aws_access_key_id=keys["key"], aws_secret_access_key=keys["secret"],
            config=botocore.config.Config(retries={"max_attempts": 1}, connect_timeout=5, read_timeout=30),
        )

    def _setup_writer(self) -> Dict[str, str]:
        iam = self._client("iam", {"key": "setup", "secret": "setup"})  # before authentication starts
        return self._user(iam, "writer", ["*"])

    def _make_user(self, name: str, actions: List[str]) -> Dict[str, str]:
        return self._user(self._client("iam", self.writer), name, actions)

    @staticmethod
    def _user(iam, name: str, actions: List[str]) -> Dict[str, str]:
        iam.create_user(UserName=name)
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": actions, "Resource": "*"}]}
        iam.put_user_policy(UserName=name, PolicyName=f"{name}-policy", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return {"key": key["AccessKeyId"], "secret": key["SecretAccessKey"]}

    def create_bucket(self, name: str) -> None:
        self._client("s3", self.writer).create_bucket(Bucket=name)
        self.buckets.append(name)

    def fsspec_conf(self, keys: Optional[Dict[str, str]] = None) -> Dict[str, Dict]:
        """fsspec's configuration for ``s3://`` through the relay: ``fsspec.config.conf.update(...)``."""
        keys = keys or self.writer
        return {
            "s3": {
                "endpoint_url": self.endpoint, "key": keys["key"], "secret": keys["secret"],
                "client_kwargs": {"region_name": REGION},
                # a cut network fails a request in seconds: short timeouts, one retry by botocore
                "config_kwargs": {"connect_timeout": 2, "read_timeout": 20, "retries": {"max_attempts": 2}},
            }
        }

    def stop(self) -> None:
        if getattr(self, "relay", None) is not None:
            self.relay.cut()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()


# --- what the workers take ---------------------------------------------------------------------------------------


class Url(str):
    """A checkpoint directory at a URL, joined with ``/`` as a ``Path`` is (a ``str``: Lightning takes it as it is)."""

    def __truediv__(self, name: str) -> "Url":
        return Url(f"{self.rstrip('/')}/{name}")

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        pass  # object stores have no directories to make


def directory(text: str):
    """A worker's ``--ckpt-dir``: a local ``Path`` or a ``Url``."""
    from pathlib import Path

    return Url(text) if "://" in text else Path(text)


def configure(conf_json: Optional[str]) -> None:
    """A worker's ``--fsspec-conf``: what a user puts in fsspec's configuration (``FSSPEC_S3_*`` variables)."""
    if conf_json:
        import fsspec.config

        fsspec.config.conf.update(json.loads(conf_json))
