"""``aer image``: pulling (with progress), importing, listing, inspecting and removing OCI images."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, DownloadColumn, Progress, TaskID, TextColumn
from rich.table import Table
from rich.text import Text

from auraed.api.aurae.containers import v0 as containers_pb
from auraed.client.cli.arguments import add_command, add_group
from auraed.client.cli.calls import CONTAINERS, CliError, call, call_timeout, session
from auraed.client.cli.output import (
    age_text,
    console,
    emit,
    kv_table,
    lines_text,
    print_json,
    report,
    short_id,
    size_text,
    time_text,
)
from auraed.client.client import AuraeClient


def _image_summary(verb: str, image: containers_pb.Image) -> str:
    return f"{verb} {image.id}" + (f" as {', '.join(image.references)}" if image.references else "")


def _progress_line(progress: containers_pb.PullProgress) -> str:
    overall = f"{size_text(progress.done)}/{size_text(progress.total)}"
    if progress.digest:
        layer = f"{size_text(progress.layer_done)}/{size_text(progress.layer_total)}"
        return f"{progress.phase} {short_id(progress.digest)} {layer} (total {overall})"
    return f"{progress.phase} (total {overall})" if progress.total else progress.phase


class _PullBars:
    """Rich progress bars for a pull: one per layer, and the whole."""

    def __init__(self, bars: Progress) -> None:
        self.bars = bars
        self.total = bars.add_task("total", total=None)
        self.layers: dict[str, TaskID] = {}
        self.sizes: dict[TaskID, int] = {}

    def show(self, progress: containers_pb.PullProgress) -> None:
        if progress.digest:
            task = self.layers.get(progress.digest)
            if task is None:
                task = self.layers[progress.digest] = self.bars.add_task("", total=None)
            self.sizes[task] = progress.layer_total
            self.bars.update(
                task,
                description=f"{short_id(progress.digest)} {progress.phase}",
                completed=progress.layer_done,
                total=progress.layer_total or None,
            )
        if progress.phase == "done":  # layer messages are sampled: the last one may be missing
            for digest, task in self.layers.items():
                self.bars.update(task, description=f"{short_id(digest)} done", completed=self.sizes[task])
        self.bars.update(
            self.total,
            description=f"total {progress.phase}",
            completed=progress.done,
            total=progress.total or None,
        )


def cmd_image_pull(args: argparse.Namespace) -> int:
    auth = None
    if args.username is not None or args.password_stdin:
        if args.username is None or not args.password_stdin:
            raise CliError("--username and --password-stdin go together")
        password = sys.stdin.read().rstrip("\r\n") if sys.stdin is not None else ""  # None: closed
        if not password:
            raise CliError("--password-stdin: no password on stdin")
        auth = containers_pb.RegistryAuth(username=args.username, password=password)
    elif args.registry_token:
        auth = containers_pb.RegistryAuth(registry_token=args.registry_token)
    request = containers_pb.ContainerServicePullImageRequest(reference=args.reference, auth=auth)
    timeout = call_timeout(args, open_ended=True)
    bars = (
        None
        if args.json or not console.is_terminal
        else Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(binary_units=True), console=console
        )
    )

    async def body(client: AuraeClient) -> containers_pb.Image | None:
        image, view = None, _PullBars(bars) if bars else None
        async for reply in client.stream(CONTAINERS, "PullImage", request, timeout):
            image = reply.image or image
            if args.json:
                emit(args, reply, "")
            elif reply.progress is not None and view is not None:
                view.show(reply.progress)
            elif reply.progress is not None:
                print(_progress_line(reply.progress), flush=True)
        return image

    with bars if bars is not None else contextlib.nullcontext():
        image = session(args, body)
    if image is None:
        raise CliError(f"the pull of {args.reference} ended without an image")
    if not args.json:
        console.print(_image_summary("pulled", image))
    return 0


def cmd_image_import(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceImportImageLayoutRequest(
        path=str(Path(args.path).expanduser().absolute()),
        ref_name=args.ref_name or "",
        reference=args.reference or "",
    )
    waiting = f"importing {request.path}"
    reply = call(args, CONTAINERS, "ImportImageLayout", request, waiting=waiting, open_ended=True)
    report(args, reply, _image_summary("imported", reply.image))
    return 0


def cmd_image_list(args: argparse.Namespace) -> int:
    reply = call(args, CONTAINERS, "ListImages", containers_pb.ContainerServiceListImagesRequest())
    if args.json:
        print_json(reply)
        return 0
    table = Table("REFERENCES", "ID", "SIZE", "LAYERS", "CREATED", box=None, header_style="bold")
    for image in reply.images:
        table.add_row(
            Text("\n".join(image.references) or "<none>", style="cyan"),
            short_id(image.id),
            size_text(image.size),
            str(len(image.layers)),
            age_text(image.created_at),
        )
    console.print(table if reply.images else "no images")
    return 0


def _image_rows(image: containers_pb.Image) -> list[tuple[str, str]]:
    config = image.config or containers_pb.ImageConfig()
    return [
        ("id", image.id),
        ("references", lines_text(image.references)),
        ("repo digests", lines_text(image.repo_digests)),
        ("manifest digest", image.manifest_digest),
        ("size", f"{size_text(image.size)} ({image.size} bytes)"),
        ("platform", f"{image.os}/{image.architecture}"),
        ("created", time_text(image.created_at) if image.created_at else "-"),
        ("layers", lines_text(image.layers)),
        ("entrypoint", shlex.join(config.entrypoint) or "-"),
        ("cmd", shlex.join(config.cmd) or "-"),
        ("env", lines_text(config.env)),
        ("working dir", config.working_dir or "-"),
        ("user", config.user or "-"),
        ("stop signal", config.stop_signal or "-"),
        ("volumes", lines_text(config.volumes)),
        ("exposed ports", lines_text(config.exposed_ports)),
        ("labels", lines_text([f"{k}={v}" for k, v in sorted(config.labels.items())])),
    ]


def cmd_image_inspect(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceImageStatusRequest(image=args.image)
    image = call(args, CONTAINERS, "ImageStatus", request).image or containers_pb.Image()
    if args.json:
        print_json(image)
    else:
        kv_table(f"image {args.image}", _image_rows(image))
    return 0


def cmd_image_remove(args: argparse.Namespace) -> int:
    request = containers_pb.ContainerServiceRemoveImageRequest(image=args.image)
    reply = call(args, CONTAINERS, "RemoveImage", request)
    if reply.collection_deferred:
        report(args, reply, f"removed {args.image}; its space is freed once the pulls under way end")
    else:
        report(args, reply, f"removed {args.image}, freed {size_text(reply.freed_bytes)}")
    return 0


def add_commands(subparsers: Any) -> None:
    image = add_group(subparsers, "image", "pull, import, list, inspect and remove OCI images")
    pull = add_command(image, "pull", cmd_image_pull, "pull an image from a registry, showing progress")
    pull.add_argument("reference", metavar="REF", help='e.g. "busybox" or "registry.example:5000/app:1.0"')
    credentials = pull.add_mutually_exclusive_group()
    credentials.add_argument("--username", metavar="U", help="registry user; the password comes on stdin")
    credentials.add_argument("--registry-token", metavar="T", help="a bearer token for the registry")
    pull.add_argument("--password-stdin", action="store_true", help="read the password from stdin")

    load = add_command(image, "import", cmd_image_import, "import an OCI image layout (directory or tar)")
    load.add_argument("path", metavar="PATH", help="on the daemon's machine; made absolute here")
    load.add_argument("--ref-name", metavar="NAME", help="which image of the layout (its ref name)")
    load.add_argument("--reference", metavar="REF", help="the name to store it as (default: the ref name)")

    add_command(image, "ls", cmd_image_list, "the stored images")
    inspect = add_command(image, "inspect", cmd_image_inspect, "everything about one image")
    inspect.add_argument("image", metavar="IMAGE", help="a reference, image id or repo digest")
    remove = add_command(image, "rm", cmd_image_remove, "remove an image and collect what nothing else uses")
    remove.add_argument("image", metavar="IMAGE", help="a reference, image id or repo digest")
