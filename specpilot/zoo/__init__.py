"""The model zoo: small trained pairs shipped with specpilot (`specpilot.zoo`), each a folder of
target/, dflash/ and pard/ HF model directories with model cards. Retrain with train/train_zoo.py."""

from importlib.resources import files
from pathlib import Path

PAIRS = ("code-qwen3", "code-qwen3-next")


def pair_dir(name: str) -> Path:
    return Path(str(files(__name__) / name))
