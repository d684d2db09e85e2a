# A stand-in for torch's type information, for `make lint` only: torch (about 5 GB with its
# CUDA libraries) is not installed by `make venv`. It declares what the typed example needs,
# with torch's own signatures (torch/utils/data/{dataset,dataloader}.py); everything else is Any.
from typing import Any

def __getattr__(name: str) -> Any: ...
