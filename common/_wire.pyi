"""Type stub of the compiled wire reader (common/_wire.pyx)."""

MAX_DEPTH: int
FAULTS: dict[int, str]
JOB_FIELDS: tuple[tuple[int, int], ...]
RESULT_FIELDS: tuple[tuple[int, int], ...]
JOB_RECORD_BYTES: int
RESULT_RECORD_BYTES: int

class WireError(ValueError):
    fault: str
    at: int
    def __init__(self, fault: str, at: int) -> None: ...

def skip_value(data: bytes | bytearray | memoryview, pos: int = 0, max_depth: int = 64) -> int: ...
def id_problem(raw_id: bytes | bytearray | memoryview) -> str | None: ...
