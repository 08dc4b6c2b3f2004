"""``r3operator routing``: inspect and convert routing-data (``.r3r``) files.

Errors a user can cause (corrupt, truncated or foreign file, bad ``.npy`` input) exit 1 with one line on
stderr naming the file, never a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from pathlib import Path

import numpy as np
import typer

from r3operator.routing.codec import encode
from r3operator.routing.errors import RoutingDataError
from r3operator.routing.store import (
    payload_checksum,
    read_file,
    read_stored,
    validate_sample_id,
    write_file,
)

app = typer.Typer(help="Inspect and convert routing-data files.", no_args_is_help=True, add_completion=False)


def _die(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=1)


@app.command()
def inspect(file: Path = typer.Argument(..., help="A routing-data (.r3r) file.")) -> None:
    """Print the header as JSON (with "payload_bytes") plus "checksum_ok"; exit 1 if the payload checksum
    does not match."""
    try:
        header, payload = read_stored(file)
    except (RoutingDataError, OSError) as exc:
        raise _die(str(exc) if str(file) in str(exc) else f"{file}: {exc}") from None
    checksum_ok = payload_checksum(payload) == header.checksum
    typer.echo(json.dumps({**header.to_json_dict(), "checksum_ok": checksum_ok}, indent=2))
    if not checksum_ok:
        raise _die(f"{file}: payload checksum mismatch (file is corrupt)")


@app.command("encode")
def encode_cmd(
    npy: Path = typer.Option(..., "--npy", help="Input .npy of shape (tokens, layers, top_k)."),
    out: Path = typer.Option(..., "--out", help="Output .r3r file."),
    start: int = typer.Option(0, "--start", min=0, help="Absolute token position of row 0."),
    num_experts: int | None = typer.Option(
        None, "--num-experts", min=1, help="Experts per MoE layer (default: max id + 1, a lower bound)."
    ),
    step: int = typer.Option(0, "--step", min=0),
    sample_id: str | None = typer.Option(None, "--sample-id", help="Default: the output file's stem."),
    policy_version: int = typer.Option(0, "--policy-version", min=0),
) -> None:
    """Convert a .npy routes array into a routing-data file (atomic write)."""
    try:
        if not stat.S_ISREG(npy.stat().st_mode):  # np.load of a FIFO would wait for a writer forever
            raise _die(f"{npy}: not a regular file")
        array = np.load(npy, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise _die(f"{npy}: not a readable .npy array ({exc})") from None
    if not isinstance(array, np.ndarray):
        raise _die(f"{npy}: holds an archive, not a single array")
    sample = sample_id if sample_id is not None else out.name.removesuffix(".r3r")
    try:
        validate_sample_id(sample)
        routes = encode(array, start=start, num_experts=num_experts)
        if num_experts is None:
            num_experts = int(array.max()) + 1 if array.size else 1
        write_file(
            out,
            routes,
            num_experts=num_experts,
            policy_version=policy_version,
            step=step,
            sample_id=sample,
        )
    except RoutingDataError as exc:
        raise _die(f"{npy}: {exc}") from None
    except OSError as exc:
        raise _die(f"{out}: cannot write ({exc})") from None
    payload_bytes = read_stored(out)[0].payload_bytes
    typer.echo(f"wrote {out} {routes.shape} {routes.dtype} ({payload_bytes} payload bytes)")


@app.command("decode")
def decode_cmd(
    file: Path = typer.Argument(..., help="A routing-data (.r3r) file."),
    npy: Path = typer.Option(..., "--npy", help="Output .npy path."),
) -> None:
    """Verify a routing-data file and write its routes as a .npy array."""
    try:
        record = read_file(file, verify=True)
    except (RoutingDataError, OSError) as exc:
        raise _die(str(exc) if str(file) in str(exc) else f"{file}: {exc}") from None
    target = npy if npy.suffix == ".npy" else npy.with_name(npy.name + ".npy")  # np.save's naming rule
    try:
        _save_npy_atomic(target, record.array())
    except OSError as exc:
        raise _die(f"{target}: cannot write ({exc})") from None


def _save_npy_atomic(path: Path, array: np.ndarray) -> None:
    """Write into a temp file in the same directory and rename it into place: a full disk or a crash leaves
    the previous file (or none), never a truncated .npy that loads as garbage or fails far from here."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "xb") as fh:
            np.save(fh, array, allow_pickle=False)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
