"""What Lightning 2.0.x's own loop tests hold of a checkpoint's loop state and of a failure inside a validation stays
true with the import, in one process: the loop state is Lightning's own (plain values, its keys), the data position
is an entry of its own, and a run that failed inside a validation and resumes finishes that validation with the
metric the uninterrupted run logged."""
import pytest
import torch

import lightning_fsdp_resume  # noqa: F401  (the import under test)
from lightning_fsdp_resume import _participants
from support.flavours import NATIVE, TRAINER_UNDER_TEST

pytestmark = pytest.mark.skipif(NATIVE, reason="the shim's loop patches: native Lightning is not patched")
L = TRAINER_UNDER_TEST.module()
callbacks = TRAINER_UNDER_TEST.module("callbacks")


class Failure(Exception):
    pass


class Net(L.LightningModule):
    def __init__(self, fail_at=None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.fail_at, self.logged = fail_at, []

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).pow(2).mean()

    def validation_step(self, batch, batch_idx):
        if (self.global_step, batch_idx) == self.fail_at:
            raise Failure
        self.log("val_loss", self.layer(batch[0]).pow(2).mean())

    def on_validation_end(self):
        self.logged.append((self.global_step, self.trainer.callback_metrics["val_loss"].item()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data(size: int = 24):
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(size, 4, generator=torch.Generator().manual_seed(0))), batch_size=4)


def _trainer(tmp_path, **kwargs):
    return L.Trainer(default_root_dir=tmp_path, accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def _plain(value) -> bool:
    if isinstance(value, dict):
        return all(_plain(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return all(_plain(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def test_the_loop_state_is_lightnings_own_and_the_position_an_entry_of_its_own(tmp_path):
    saving = callbacks.ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    _trainer(tmp_path, callbacks=[saving], limit_val_batches=0).fit(Net(), _data())
    checkpoint = torch.load(tmp_path / "step=2.ckpt", weights_only=False)
    loops = checkpoint["loops"]["fit_loop"]
    assert _plain(loops), "the loop state holds something other than plain values"
    assert set(loops["epoch_loop.state_dict"]) == {"_batches_that_stepped"}
    assert checkpoint["data_position"]["positions"][0]["batches"] == 2
    assert checkpoint["data_position"]["world_size"] == 1


def test_a_failure_inside_a_validation_resumes_by_finishing_it_with_the_uninterrupted_metric(tmp_path):
    """Validation every 2 of 6 batches, 3 batches each; a failure in batch 1 of the validation at step 4, saved by
    ``OnExceptionCheckpoint``: the resumed run validates at step 4 again, with the uninterrupted run's mean."""
    torch.manual_seed(0)
    reference = Net()
    _trainer(tmp_path / "ref", val_check_interval=2).fit(reference, _data(), _data(12))
    torch.manual_seed(0)
    failing = Net(fail_at=(4, 1))
    with pytest.raises(Failure):
        _trainer(tmp_path, val_check_interval=2, callbacks=[callbacks.OnExceptionCheckpoint(tmp_path)]).fit(
            failing, _data(), _data(12))
    resumed = Net()
    trainer = _trainer(tmp_path / "resumed", val_check_interval=2)
    trainer.fit(resumed, _data(), _data(12), ckpt_path=str(tmp_path / "on_exception.ckpt"))
    assert failing.logged == reference.logged[:1]
    assert resumed.logged == reference.logged[1:], "the validation at step 4 and the ones after it"
    assert trainer.fit_loop.epoch_loop.val_loop.batch_progress.current.completed == 3


class Visits(_participants.Entry):
    """A checkpoint entry of the run no module of the package knows: how many checkpoints it made."""

    key = "visits"

    def __init__(self) -> None:
        self.made, self.asked_by, self.handed = 0, [], []

    def state(self, trainer, ours):
        self.made += 1
        self.asked_by.append((trainer.global_step, ours))
        return {"made": self.made}

    def loaded(self, trainer, checkpoint, where, ours):
        self.handed.append((checkpoint.pop(self.key, None), where, trainer.state.fn, ours))


class Reading(Net):
    def on_load_checkpoint(self, checkpoint):
        self.read = set(checkpoint)


def test_an_entry_no_module_knows_rides_every_checkpoint_and_is_taken_before_the_hooks_read_it(tmp_path):
    """A registered ``Entry`` is the whole of what a new state of the run needs: every checkpoint carries its state
    (asked on each save, told the strategy is not the package's FSDP one), and the call that resumes hands it the
    loaded checkpoint before Lightning's hooks read it, so what it takes they do not see."""
    visits = Visits()
    _participants.register(visits)
    try:
        saving = callbacks.ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=2, save_top_k=-1)
        _trainer(tmp_path, callbacks=[saving], limit_val_batches=0).fit(Net(), _data(8))
        assert visits.asked_by == [(2, False)]
        assert torch.load(tmp_path / "step=2.ckpt", weights_only=False)["visits"] == {"made": 1}
        resumed = Reading()
        _trainer(tmp_path, limit_val_batches=0).fit(resumed, _data(8), ckpt_path=tmp_path / "step=2.ckpt")
        assert visits.handed == [({"made": 1}, f"The checkpoint {str(tmp_path / 'step=2.ckpt')!r}", "fit", False)]
        assert "visits" not in resumed.read and "data_position" in resumed.read
    finally:
        _participants._ENTRIES.pop(Visits.key)
    assert "visits" not in {entry.key for entry in _participants.entries()}
