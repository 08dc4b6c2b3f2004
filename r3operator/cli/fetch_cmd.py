"""`r3operator fetch URI ROOT`: copy an hf://, s3:// or gs:// source into ``ROOT/<cache key>`` once and print the local
path; ``--verify`` only checks a copy. The operator's model-fetch Job, the dataset init container and the
engines' and trainer's ``verify-model`` init containers run exactly this (operator/builders/model_cache.py).

Exit codes: 0 the copy is there and complete; 1 it is not (``--verify``) or the fetch failed; 2 bad URI.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer


def fetch(
    uri: Annotated[str, typer.Argument(help="hf://org/name[@revision], s3://bucket/prefix or gs://bucket/prefix.")],
    root: Annotated[Path, typer.Argument(help="The cache root; the copy goes to ROOT/<cache key>.")],
    revision: Annotated[str | None, typer.Option(help="hf:// revision, unless the URI pins one (@revision).")] = None,
    endpoint_url: Annotated[
        str | None,
        typer.Option(
            "--endpoint-url",
            help="S3-compatible store URL (default: AWS S3; for gs://, https://storage.googleapis.com).",
        ),
    ] = None,
    region: Annotated[str | None, typer.Option(help="S3 region.")] = None,
    verify_only: Annotated[
        bool, typer.Option("--verify", help="Only check the copy (ready marker and file sizes); never download.")
    ] = False,
    checksums: Annotated[bool, typer.Option(help="Also re-read every file against its sha256.")] = False,
) -> None:
    """Fetch a model or dataset into a cache directory (credentials from HF_TOKEN / AWS_* in the environment;
    for gs://, AWS_* hold a Cloud Storage HMAC key)."""
    from r3operator.api.sources import SourceURIError, parse_source_uri
    from r3operator.runtime import fetch as fetching

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        source = parse_source_uri(uri, revision=revision)
        if not source.fetched:
            raise SourceURIError(f"{uri}: only hf://, s3:// and gs:// sources are fetched")
        if verify_only:
            done = fetching.verify(fetching.target_directory(source, root), checksums=checksums)
        else:
            s3 = fetching.S3Options(endpoint_url=endpoint_url, region=region)
            done = fetching.fetch(uri, root, revision=revision, s3=s3, checksums=checksums)
    except SourceURIError as exc:
        typer.echo(f"r3operator fetch: {exc}", err=True)
        raise typer.Exit(2) from None
    except (fetching.SourceNotReady, fetching.FetchError) as exc:
        typer.echo(f"r3operator fetch: {exc}", err=True)
        raise typer.Exit(1) from None
    typer.echo(str(done.path))
