"""Routing data plane: routed-expert codecs, on-volume store, multi-turn stitching (NumPy only)."""

from r3operator.routing.codec import (
    ROUTE_DTYPES,
    RoutedExperts,
    decode,
    encode,
    from_vllm,
    from_wire,
    narrowest_dtype,
    to_torch,
    to_wire,
    validate_routes,
)
from r3operator.routing.errors import (
    RoutingDataError,
    RoutingFileError,
    RoutingFileMissingError,
    RoutingFileUnreadableError,
)
from r3operator.routing.stitch import TrajectoryRoutes, check_row_count
from r3operator.routing.store import RoutingHeader, RoutingRecord, RoutingStore, read_file, write_file

__all__ = [
    "ROUTE_DTYPES",
    "RoutedExperts",
    "RoutingDataError",
    "RoutingFileError",
    "RoutingFileMissingError",
    "RoutingFileUnreadableError",
    "RoutingHeader",
    "RoutingRecord",
    "RoutingStore",
    "TrajectoryRoutes",
    "check_row_count",
    "decode",
    "encode",
    "from_vllm",
    "from_wire",
    "narrowest_dtype",
    "read_file",
    "to_torch",
    "to_wire",
    "validate_routes",
    "write_file",
]
