"""Image pull: a ~50 MB, 3-layer image from a local registry, pulled and unpacked, against skopeo + umoci.

    .venv/bin/python bench/image_pull.py [--iterations 5] [--json-only]

The image is tests.support.images.build_large_layout (busybox + 25 MB of random bytes + 25 MB of
text, gzip level 1: 44.8 MB of blobs, 54 MB unpacked), pushed with skopeo to a real
docker-registry (tests.support.registry.LocalRegistry) on 127.0.0.1. Each iteration, in an order
that alternates, after ``sync`` and ``--gap-ms`` of idle time:

* ``auraed`` - PullImage through a daemon started for this iteration alone (fresh state dir, so
  nothing is cached; its start is not timed), from the call until the reply carrying the image.
  auraed downloads the 3 layers concurrently and unpacks each while it downloads (one thread per
  layer), writes every blob to its content store (fsync, rename) and each layer into its own
  snapshot directory (the overlay lower dirs);
* ``skopeo + umoci`` - ``skopeo copy docker://... oci:<dir>:big`` (blobs to disk, fsync'd, digests
  verified) then ``umoci unpack --image <dir>:big <bundle>`` (all layers applied into one merged
  rootfs, plus a runtime config.json and an mtree manifest umoci hashes every file for). ``umoci
  raw unpack`` (the rootfs only: no mtree, no config) of the same layout is timed after it, as a
  stricter peer for the unpack half.

Both write all blobs to disk with fsync and unpack every layer without fsync; the rootfs bytes
are checked to match (the layers of this image never overwrite each other's files, so auraed's
three snapshots hold exactly what umoci's merged rootfs holds).

Where auraed's time goes: its progress stream gives when each layer was done; references measured
afterwards with auraed's own code in this process split the work: download only (verified,
discarded), download into the content store (write + sha256 + fsync), and unpacking the stored
blobs, each over the 3 layers concurrently as the daemon does; gunzip alone; and the cost of the
pull's _TeeReader (which hands the downloaded bytes to the unpacker) at 8 KiB and 64 KiB reads.

Target (issue): auraed at most 1.0x skopeo + umoci (at least as fast), median seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common import (
    Daemon,
    exit_on_sigterm,
    machine_info,
    make_pki,
    print_json,
    print_lines,
    print_table,
    ratio,
    summarize,
    temp_dir,
    verdict,
)
from container_start import source_state

from auraed.api.aurae.containers import v0 as pb
from auraed.images.content import LocalStore, remove_tree
from auraed.images.images import _TeeReader
from auraed.images.registry import RegistryClient
from auraed.images.unpack import unpack_layer
from auraed.pki import PkiPaths
from auraed.references import parse_reference

if TYPE_CHECKING:
    from tests.support.images import BuiltImage
    from tests.support.registry import LocalRegistry

CONTAINERS = "aurae.containers.v0.ContainerService"
REPO = Path(__file__).resolve().parents[1]
REPOSITORY = "big:1"
TARGET_RATIO = 1.0
PULL_TIMEOUT = 300.0
TOOL_TIMEOUT = 300.0
LAYER_THREADS = 3  # auraed.images.images.LAYER_CONCURRENCY
REFERENCE_RUNS = 3
MB = 1e6


def tests_support() -> None:
    """Make ``tests.support`` importable: scripts run with bench/ (not the repository) on sys.path."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))


# ------------------------------------------------------------------------------ auraed


async def auraed_pull(daemon: Daemon, reference: str) -> dict[str, Any]:
    """PullImage until the image arrives; seconds since the call for each layer's last event."""
    request = pb.ContainerServicePullImageRequest(reference=reference)
    layers_done: dict[str, float] = {}
    first_byte = None
    image = None
    async with daemon.client() as client:
        start = time.perf_counter()
        async for reply in client.stream(CONTAINERS, "PullImage", request, timeout=PULL_TIMEOUT):
            now = time.perf_counter() - start
            progress = reply.progress
            if progress is not None and progress.phase == "downloading" and first_byte is None:
                first_byte = now
            if progress is not None and progress.phase == "unpacking":
                layers_done[progress.digest] = now
            if reply.image is not None:
                image = reply.image
        total = time.perf_counter() - start
    if image is None:
        raise RuntimeError("PullImage ended without an image")
    return {"total": total, "first_progress": first_byte or 0.0, "layers_done": layers_done, "image": image}


def snapshot_dirs(daemon: Daemon, image: BuiltImage) -> list[Path]:
    snapshots = daemon.root / "state" / "images" / "snapshots"
    return [snapshots / layer.diff_id.split(":", 1)[1] for layer in image.layers]


def check_store(daemon: Daemon, image: BuiltImage) -> None:
    """The daemon holds exactly the image's blobs and one snapshot per layer, nothing else."""
    store = daemon.root / "state" / "images"
    blobs = {p.name for p in (store / "blobs" / "sha256").iterdir()}
    wanted = {d.split(":", 1)[1] for d in (image.manifest_digest, image.config_digest)}
    wanted |= {layer.digest.split(":", 1)[1] for layer in image.layers}
    snapshots = sorted(p.name for p in (store / "snapshots").iterdir())
    expected = sorted(layer.diff_id.split(":", 1)[1] for layer in image.layers)
    if blobs != wanted or snapshots != expected:
        raise RuntimeError(f"auraed's store holds {sorted(blobs)} / {snapshots}, not the image")


# ------------------------------------------------------------------------------ the peer


def timed_command(argv: list[str]) -> float:
    start = time.perf_counter()
    result = subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=TOOL_TIMEOUT, check=False
    )
    elapsed = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr[-2000:]!r}")
    return elapsed


def peer_pull(registry_host: str, layout: Path, bundle: Path, raw_rootfs: Path) -> dict[str, float]:
    source = f"docker://{registry_host}/{REPOSITORY}"
    copy = timed_command(["skopeo", "copy", "--quiet", "--src-tls-verify=false", source, f"oci:{layout}:big"])
    unpack = timed_command(["umoci", "unpack", "--image", f"{layout}:big", str(bundle)])
    os.sync()
    raw = timed_command(["umoci", "raw", "unpack", "--image", f"{layout}:big", str(raw_rootfs)])
    return {
        "total": copy + unpack,
        "skopeo_copy": copy,
        "umoci_unpack": unpack,
        "umoci_raw_unpack": raw,
        "total_with_raw_unpack": copy + raw,
    }


# ------------------------------------------------------------------------------ checks


def tree_summary(roots: list[Path]) -> tuple[int, int]:
    """Regular files and their bytes under ``roots`` together."""
    files = size = 0
    for root in roots:
        for directory, _, names in os.walk(root):
            for name in names:
                stat = os.lstat(os.path.join(directory, name))
                if not os.path.islink(os.path.join(directory, name)):
                    files += 1
                    size += stat.st_size
    return files, size


# ------------------------------------------------------------------------------ references


def in_threads(function: Callable[[int], float], count: int) -> list[float]:
    """Run ``function(i)`` for i < count on LAYER_THREADS threads, as the daemon runs layers."""
    with ThreadPoolExecutor(LAYER_THREADS) as pool:
        return list(pool.map(function, range(count)))


def references(registry_host: str, image: BuiltImage, scratch: Path) -> dict[str, list[float]]:
    """auraed's own pieces, in this process, each over all layers concurrently: seconds per run."""
    results: dict[str, list[float]] = {}
    for run in range(REFERENCE_RUNS):
        work = scratch / f"run-{run}"
        work.mkdir()
        try:
            for name, seconds in reference_run(registry_host, image, work).items():
                results.setdefault(name, []).append(seconds)
        finally:
            remove_tree(work)
    return results


def reference_run(registry_host: str, image: BuiltImage, work: Path) -> dict[str, float]:
    ref = parse_reference(f"{registry_host}/{REPOSITORY}")
    measured: dict[str, float] = {}
    store = LocalStore(work / "store")
    with RegistryClient() as client:
        layers = client.resolve(ref).layers

        def discard(i: int) -> float:
            with client.fetch_blob(ref, layers[i]) as stream:
                for _ in stream:
                    pass
            return 0.0

        def to_store(i: int) -> float:
            writer = store.writer(layers[i].digest, layers[i].size)
            with client.fetch_blob(ref, layers[i]) as stream:
                for chunk in stream:
                    writer.write(chunk)
            begin = time.perf_counter()
            writer.commit()
            return time.perf_counter() - begin

        os.sync()
        start = time.perf_counter()
        in_threads(discard, len(layers))
        measured["download_verify_discard"] = time.perf_counter() - start
        os.sync()
        start = time.perf_counter()
        commits = in_threads(to_store, len(layers))
        measured["download_to_store_fsync"] = time.perf_counter() - start
        measured["of_which_longest_fsync_rename"] = max(commits)

    def unpack(i: int) -> float:
        layer = image.layers[i]
        target = work / f"unpack-{i}"
        target.mkdir()
        with store.blob_path(layer.digest).open("rb") as stream:
            stats = unpack_layer(stream, target, media_type=layer.media_type)
        if stats.diff_id != layer.diff_id:
            raise RuntimeError(f"layer {i} unpacked to {stats.diff_id}")
        return 0.0

    def gunzip(i: int) -> float:
        decompressor = zlib.decompressobj(wbits=31)
        with store.blob_path(image.layers[i].digest).open("rb") as stream:
            while chunk := stream.read(1 << 20):
                decompressor.decompress(chunk)
        return 0.0

    os.sync()
    start = time.perf_counter()
    in_threads(unpack, len(image.layers))
    measured["unpack_stored_blobs"] = time.perf_counter() - start
    start = time.perf_counter()
    in_threads(gunzip, len(image.layers))
    measured["gunzip_only"] = time.perf_counter() - start
    blobs = [store.blob_path(layer.digest) for layer in image.layers]
    measured["tee_reader_8KiB_reads"] = tee_reader_cost(blobs, 8 << 10)
    measured["tee_reader_64KiB_reads"] = tee_reader_cost(blobs, 64 << 10)
    return measured


def tee_reader_cost(blobs: list[Path], read_size: int) -> float:
    """Seconds for the pull's _TeeReader (download -> blob file + unpacker) to hand over every byte of
    the blobs, arriving in the registry client's 1 MiB chunks, in reads of ``read_size`` (8 KiB is
    what gzip.GzipFile asks its source for on Python 3.11), with nothing else done."""

    def chunks(path: Path) -> Iterator[bytes]:
        with path.open("rb") as file:
            while chunk := file.read(1 << 20):
                yield chunk

    datas = [list(chunks(path)) for path in blobs]  # read first: only the tee is timed
    start = time.perf_counter()
    for data in datas:
        reader = _TeeReader(iter(data), lambda chunk: None)
        while reader.read(read_size):
            pass
    return time.perf_counter() - start


# ------------------------------------------------------------------------------ the run


def build_and_push(root: Path, registry: LocalRegistry) -> BuiltImage:
    tests_support()
    from tests.support.images import build_large_layout, push_layout

    image = build_large_layout(root / "layout", ref_name="big")
    push_layout(image, f"{registry.host}/{REPOSITORY}")
    return image


def run(
    args: argparse.Namespace, root: Path, pki: PkiPaths, registry: LocalRegistry, image: BuiltImage
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    results: dict[str, list[dict[str, Any]]] = {"auraed": [], "peer": []}
    checks: dict[str, Any] = {}
    reference = f"{registry.host}/{REPOSITORY}"
    for i in range(args.iterations):
        order = ("auraed", "peer") if i % 2 == 0 else ("peer", "auraed")
        for series in order:
            if series == "auraed":
                daemon = Daemon(root / f"daemon-{i}", pki)
                try:
                    daemon.start()
                    os.sync()
                    time.sleep(args.gap_ms / 1000)
                    pulled = asyncio.run(auraed_pull(daemon, reference))
                    if pulled["image"].id != image.config_digest or len(pulled["image"].layers) != 3:
                        raise RuntimeError(f"auraed pulled {pulled['image']}")
                    check_store(daemon, image)
                    if i == 0:
                        checks["auraed_snapshots_files_bytes"] = tree_summary(snapshot_dirs(daemon, image))
                    layers = {d: pulled["layers_done"].get(layer.digest) for d, layer in
                              zip(("layer1", "layer2", "layer3"), image.layers, strict=True)}  # fmt: skip
                    results["auraed"].append(
                        {"total": pulled["total"], "first_progress": pulled["first_progress"], **layers}
                    )
                except Exception:
                    with contextlib.suppress(Exception):
                        sys.stderr.write(daemon.log()[-4000:])
                    raise
                finally:
                    daemon.cleanup()
                    remove_tree(daemon.root)
            else:
                layout, bundle, raw = root / f"oci-{i}", root / f"bundle-{i}", root / f"raw-{i}"
                try:
                    os.sync()
                    time.sleep(args.gap_ms / 1000)
                    results["peer"].append(peer_pull(registry.host, layout, bundle, raw))
                    if i == 0:
                        checks["umoci_rootfs_files_bytes"] = tree_summary([bundle / "rootfs"])
                        checks["umoci_raw_rootfs_files_bytes"] = tree_summary([raw])
                finally:
                    for directory in (layout, bundle, raw):
                        remove_tree(directory)
    if not (
        checks["auraed_snapshots_files_bytes"]
        == checks["umoci_rootfs_files_bytes"]
        == checks["umoci_raw_rootfs_files_bytes"]
    ):
        raise RuntimeError(f"the unpacked trees differ: {checks}")
    return results, checks


def stats_of(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per key: summarize() in ms, plus seconds (p50, mean) for readability."""
    out: dict[str, dict[str, float]] = {}
    for key in rows[0]:
        values = [row[key] for row in rows if row[key] is not None]
        if values:
            summary = summarize(values)
            out[key] = {**summary, "p50_s": round(summary["p50_ms"] / 1000, 3)}
    return out


def report(
    args: argparse.Namespace,
    image: BuiltImage,
    raw: dict[str, list[dict[str, Any]]],
    checks: dict[str, Any],
    refs: dict[str, list[float]],
) -> dict[str, Any]:
    auraed, peer = stats_of(raw["auraed"]), stats_of(raw["peer"])
    reference = {name: summarize(values) for name, values in refs.items()}
    compressed = image.total_layer_size
    unpacked = checks["auraed_snapshots_files_bytes"][1]
    ratio_p50 = ratio(auraed["total"]["p50_ms"], peer["total"]["p50_ms"])
    ratio_raw = ratio(auraed["total"]["p50_ms"], peer["total_with_raw_unpack"]["p50_ms"])
    passed = ratio_p50 <= TARGET_RATIO

    def rate(stats: dict[str, float]) -> float:
        return round(compressed / MB / (stats["p50_ms"] / 1000), 1)

    result: dict[str, Any] = {
        "benchmark": "image_pull",
        "machine": machine_info(),
        "source": source_state(),
        "iterations": args.iterations,
        "gap_ms": args.gap_ms,
        "image": {
            "layers": len(image.layers),
            "compressed_bytes": compressed,
            "unpacked_files": checks["auraed_snapshots_files_bytes"][0],
            "unpacked_bytes": unpacked,
        },
        "checks": checks,
        "auraed": auraed,
        "peer_skopeo_umoci": peer,
        "reference_in_process": reference,
        "mb_per_s_compressed": {
            "auraed": rate(auraed["total"]),
            "skopeo_umoci": rate(peer["total"]),
            "skopeo_umoci_raw": rate(peer["total_with_raw_unpack"]),
        },
        "ratio_p50_auraed_over_peer": ratio_p50,
        "ratio_mean_auraed_over_peer": ratio(auraed["total"]["mean_ms"], peer["total"]["mean_ms"]),
        "ratio_p50_auraed_over_peer_raw_unpack": ratio_raw,
        "target": {"ratio_p50_at_most": TARGET_RATIO, "result": verdict(passed)},
    }
    if not args.json_only:
        rows: list[list[object]] = []
        for name, stats in (("auraed PullImage", auraed), ("skopeo + umoci", peer)):
            for key, values in stats.items():
                label = name if key == "total" else f"  {key}"
                rows.append(
                    [label, values["p50_ms"] / 1000, values["mean_ms"] / 1000, values["max_ms"] / 1000]
                )
        rows += [[f"alone: {k}", v["p50_ms"] / 1000, v["mean_ms"] / 1000, v["max_ms"] / 1000]
                 for k, v in reference.items()]  # fmt: skip
        print_table(
            f"Pull + unpack of {compressed / MB:.1f} MB in {len(image.layers)} layers "
            f"({unpacked / MB:.1f} MB unpacked), {args.iterations} runs each (seconds)",
            ["series / phase", "p50 s", "mean s", "max s"],
            rows,
        )
        speeds = result["mb_per_s_compressed"]
        print_lines(
            [
                f"MB/s (compressed, p50): auraed {speeds['auraed']}, skopeo+umoci {speeds['skopeo_umoci']}, "
                f"skopeo+umoci raw {speeds['skopeo_umoci_raw']}",
                f"ratio auraed/peer p50: {ratio_p50}x (mean {result['ratio_mean_auraed_over_peer']}x; "
                f"against skopeo + umoci raw unpack {ratio_raw}x)",
                f"target auraed <= {TARGET_RATIO}x: {verdict(passed)}",
            ]
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iterations", type=int, default=5, help="runs per side (default 5)")
    parser.add_argument("--gap-ms", type=int, default=500, help="idle time after sync (default 500)")
    parser.add_argument("--json-only", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    if args.iterations < 1 or args.gap_ms < 0:
        parser.error("--iterations must be positive and --gap-ms not negative")
    for tool in ("skopeo", "umoci"):
        if shutil.which(tool) is None:
            parser.exit(2, f"image_pull: {tool} is not installed\n")

    exit_on_sigterm()
    tests_support()
    from tests.support.registry import LocalRegistry

    with temp_dir("auraed-bench-pull-") as root, LocalRegistry() as registry:
        image = build_and_push(root, registry)
        raw, checks = run(args, root, make_pki(root), registry, image)
        scratch = root / "references"
        scratch.mkdir()
        refs = references(registry.host, image, scratch)
    print_json(report(args, image, raw, checks, refs))


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
