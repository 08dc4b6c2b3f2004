"""benchmarks/upgrade_row.py's own command lines (its GPU run is the `upgrade_vllm` row of gpu_accept)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from benchmarks import upgrade_row


def test_the_canary_command_the_row_builds_parses_to_the_urls_it_named() -> None:
    # The row runs this as a subprocess: the top-level parser reads the subcommand's `--…` arguments too, and with
    # abbreviations on it refused a `--new` that is a prefix of its --new-site and --new-release (no canary ran).
    urls = {"old_url": "http://a:1", "new_url": "http://b:2"}
    images = {"image": "vLLM 0.26.0, --no-norm", "old_image": "vLLM 0.22.1"}
    argv = upgrade_row.canary_args(config="/w/trainer.json", device="cpu", **images, **urls)
    args = upgrade_row.parse(argv)
    assert (args.command, args.config, args.old_url, args.new_url, args.device) == (
        "canary", "/w/trainer.json", "http://a:1", "http://b:2", "cpu",
    )  # fmt: skip
    assert (args.new_image, args.old_image) == ("vLLM 0.26.0, --no-norm", "vLLM 0.22.1")


def test_the_row_itself_takes_its_sites_and_release() -> None:
    args = upgrade_row.parse(["--work", "/tmp/w", "--new-site", "/tmp/site-0.33.0", "--new-release", "0.33.0"])
    assert args.command is None and args.work == Path("/tmp/w")
    assert (args.old_site, args.new_site, args.new_release) == ("/tmp/site", "/tmp/site-0.33.0", "0.33.0")
    assert (args.gpus, args.device) == ("0,0", "cuda")  # the GPU row's; a CPU rehearsal names none and cpu


def test_a_site_left_empty_is_the_release_this_python_has() -> None:
    env = upgrade_row.site_env({"PATH": "/usr/bin"}, ["", "/tmp/site"])
    assert env["PYTHONPATH"].split(":") == ["/tmp/site", str(upgrade_row.REPO)]
    assert env["PATH"] == "/tmp/site/bin:/usr/bin"


def test_the_canary_waits_for_the_new_sites_mark_and_names_it_when_it_never_comes(tmp_path: Path) -> None:
    site = tmp_path / "site-0.33.0"
    site.mkdir()
    with pytest.raises(TimeoutError, match=r"site-0\.33\.0/\.ready did not appear"):
        upgrade_row.wait_for_site(str(site), 0.2, poll_s=0.05)
    # The mark arriving while the row waits (the wheels still being set up during steps 1-2) ends the wait.
    marker = threading.Timer(0.2, (site / ".ready").touch)
    marker.start()
    upgrade_row.wait_for_site(str(site), 30, poll_s=0.05)
    marker.join()
    upgrade_row.wait_for_site("", 30)  # this Python's own release: nothing to wait for
    # The setup script writes the very mark the row waits for, after its import check.
    script = (upgrade_row.REPO / "scripts" / "gpu-setup-release.sh").read_text()
    assert script.rstrip().endswith(f'touch "$site/{upgrade_row.SITE_READY}"')
