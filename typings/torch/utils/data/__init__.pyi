# torch.utils.data as torch declares it (Dataset is a Generic class, not a Protocol: a dataset
# must subclass it for DataLoader to accept it under type checking).
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

_T_co = TypeVar("_T_co", covariant=True)

class Dataset(Generic[_T_co]):
    def __getitem__(self, index: Any) -> _T_co: ...
    def __add__(self, other: Dataset[_T_co]) -> Dataset[_T_co]: ...

class DataLoader(Generic[_T_co]):
    dataset: Dataset[_T_co]
    batch_size: int | None
    num_workers: int
    def __init__(
        self,
        dataset: Dataset[_T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[_T_co]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
    ) -> None: ...
    def __iter__(self) -> Iterator[Any]: ...
    def __len__(self) -> int: ...

def __getattr__(name: str) -> Any: ...
