"""Errors raised by the routing data plane.

Both derive from ``ValueError`` so callers that treat bad input generically keep working; catch
``RoutingFileError`` to tell a damaged file on the shared volume apart from a bad in-memory array.
"""

from __future__ import annotations


class RoutingDataError(ValueError):
    """A routing array or payload is malformed: the message names what is wrong (shape, dtype, id range,
    duplicate id, byte length, row count)."""


class RoutingFileError(RoutingDataError):
    """A routing-data file is corrupt, truncated, foreign or fails its checksum; the message names it."""


class RoutingFileMissingError(RoutingFileError, FileNotFoundError):
    """No routing-data file exists for the requested (step, sample id).

    Also a ``FileNotFoundError`` so callers can treat "routes missing" (fall back to native routing) apart
    from "routes damaged"."""


class RoutingFileUnreadableError(RoutingFileError):
    """A routing-data path exists but cannot be read: permission denied, an I/O error, or not a regular file
    (a FIFO would block the reader forever). The message names the file and the OS error."""
