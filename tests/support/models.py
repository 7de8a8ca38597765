"""The layers the rank programs' models are made of: the Trainer's LightningModules and Fabric's plain modules
have the same body, so that a variant (dropout, batch normalisation) means the same in both."""
from torch import nn

# what sits between the body's first linear layer and its activation, by variant
_MIDDLE = {"plain": lambda: [], "dropout": lambda: [nn.Dropout(0.3)], "batchnorm": lambda: [nn.BatchNorm1d(16)]}


def body(variant: str = "plain") -> nn.Sequential:
    """``Linear(8, 16)``, the variant's layer (``"dropout"``: masks from the rank's random number generator;
    ``"batchnorm"``: running statistics each rank updates from its own batches), ``Tanh``, ``Linear(16, 16)``."""
    return nn.Sequential(nn.Linear(8, 16), *_MIDDLE[variant](), nn.Tanh(), nn.Linear(16, 16))
