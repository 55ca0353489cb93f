"""`thinkbatch`: a JSONL of prompts in, a live progress bar, a JSONL of thinking and answers out.

Built on Typer (typed commands on click, which gives usage errors exit code 2 and `--help`) and
rich (a live bar on a terminal, plain lines otherwise): both maintained, and rich is already
the demo's. OpenAI-format files go through the Files and Batches routes with the official
`openai` SDK as the transport, which keeps the two compatible; native item lines go to
/v1/jobs. Progress reads /v1/jobs/{id}, which takes both id forms.

Exit codes: 0 completed with no failures, 3 completed with failed items, 4 failed, cancelled or
expired, 1 an HTTP, connection or input error (one line on stderr), 2 a usage error.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING
from typing import Annotated
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn
from rich.progress import Progress
from rich.progress import TextColumn
from rich.progress import TimeRemainingColumn

if TYPE_CHECKING:
    import httpx

from thinkbatch.cli import keys as keys_cli
from thinkbatch.guard import JSON_WHITESPACE
from thinkbatch.guard import is_blank

OK, USAGE, FAILED_ITEMS, ENDED_BADLY, ERROR = 0, 2, 3, 4, 1
FINISHED = ("completed", "failed", "cancelled", "expired")

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help=__doc__.split("\n\n")[0],
)
out = Console(soft_wrap=True)  # a line per record: never wrapped at 80 columns in a pipe


class CliError(Exception):
    """Reported as one line on stderr, exit code 1."""


class Format(StrEnum):
    openai = "openai"
    native = "native"


class Api:
    """The client's transports, imported when a command needs them: `thinkbatch keys` works in
    the API's image, which carries neither httpx nor the openai SDK."""

    def __init__(self, base_url: str, api_key: str | None):
        import httpx
        import openai

        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.base_url, headers=headers, timeout=60)
        self.sdk = openai.OpenAI(
            base_url=self.base_url + "/v1", api_key=api_key or "-", max_retries=2
        )

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self.http.request(method, path, **kwargs)
        _check(response)
        return response.json()


def _check(response: httpx.Response) -> None:
    if response.is_success:
        return
    try:
        error = response.json()["error"]
        text = f"{error.get('code')}: {error.get('message')}"
    except (ValueError, KeyError, TypeError):
        text = response.text[:200]
    raise CliError(f"HTTP {response.status_code} {text}")


@app.callback()
def main(
    ctx: typer.Context,
    base_url: Annotated[
        str, typer.Option(envvar="THINKBATCH_URL", help="The API's address.")
    ] = "http://127.0.0.1:8000",
    api_key: Annotated[
        str | None, typer.Option(envvar="THINKBATCH_API_KEY", help="Bearer API key.")
    ] = None,
) -> None:
    ctx.obj = Api(base_url, api_key)


def _first_line(path: Path) -> dict[str, Any]:
    with path.open("rb") as f:
        for raw in f:
            if not is_blank(raw):
                try:
                    line = json.loads(raw)
                except ValueError as error:
                    raise CliError(f"{path}: line 1 is not JSON ({error})") from None
                if not isinstance(line, dict):
                    raise CliError(f"{path}: line 1 is not a JSON object")
                return line
    raise CliError(f"{path}: no lines")


def _native_body(path: Path) -> Iterator[bytes]:
    """`{"items": [<line>, ...]}` streamed from the file, never held whole."""
    yield b'{"items":['
    first = True
    with path.open("rb") as f:
        for raw in f:
            if not is_blank(raw):
                yield (b"" if first else b",") + raw.strip(JSON_WHITESPACE)
                first = False
    yield b"]}"


@app.command()
def submit(
    ctx: typer.Context,
    file: Annotated[Path, typer.Argument(help="JSONL: OpenAI batch lines or native items.")],
    wait: Annotated[bool, typer.Option("--wait", help="Watch until it finishes.")] = False,
    window: Annotated[str, typer.Option(help="completion_window of a batch.")] = "24h",
) -> None:
    """Submit FILE: OpenAI-format lines as a batch, native item lines as a job."""
    api: Api = ctx.obj
    if not file.is_file():
        raise CliError(f"{file}: no such file")
    first = _first_line(file)
    if "url" in first and "body" in first:
        with file.open("rb") as f:
            uploaded = api.sdk.files.create(file=(file.name, f), purpose="batch")
        batch = api.sdk.batches.create(
            input_file_id=uploaded.id,
            endpoint=first["url"],
            completion_window=window,  # type: ignore[arg-type]
        )
        if batch.status == "failed":
            for e in (batch.errors.data or [])[:10] if batch.errors else []:
                print(f"line {e.line}: {e.param or '-'}: {e.message}", file=sys.stderr)
            raise typer.Exit(ENDED_BADLY)
        job_id = batch.id
    else:
        job_id = api.call(
            "POST",
            "/v1/jobs",
            content=_native_body(file),
            headers={"Content-Type": "application/json"},
        )["id"]
    out.print(job_id, highlight=False)
    if wait:
        raise typer.Exit(_watch(api, job_id))


@app.command()
def status(
    ctx: typer.Context,
    job_id: Annotated[str, typer.Argument(metavar="ID", help="A job or batch id.")],
    watch: Annotated[bool, typer.Option("--watch", help="Follow it live.")] = False,
) -> None:
    """Show a job's (or batch's) progress."""
    api: Api = ctx.obj
    if watch:
        raise typer.Exit(_watch(api, job_id))
    job = api.call("GET", f"/v1/jobs/{job_id}")
    out.print(_line(job_id, job, rate=None, eta=None), highlight=False)
    raise typer.Exit(_exit_code(job) if job["status"] in FINISHED else OK)


@app.command(name="list")
def list_(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(min=1, max=1000)] = 20,
) -> None:
    """The newest jobs and batches."""
    api: Api = ctx.obj
    for job in api.call("GET", "/v1/jobs", params={"limit": limit})["data"]:
        c = job["counts"]
        done = c["succeeded"] + c["failed"] + c["cancelled"] + c["expired"]
        out.print(
            f"{job['id']}  {job['status']:<10} {done}/{c['total']}  {job['created_at']}",
            highlight=False,
        )


@app.command()
def results(
    ctx: typer.Context,
    job_id: Annotated[str, typer.Argument(metavar="ID", help="A job or batch id.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the JSONL.")],
    fmt: Annotated[Format, typer.Option("--format", help="openai (batches) or native.")] = (
        Format.native
    ),
) -> None:
    """Write the results: native item records, or a batch's OpenAI output and error lines."""
    api: Api = ctx.obj
    written = 0
    with output.open("wb") as f:
        if fmt is Format.native:
            with api.http.stream("GET", f"/v1/jobs/{job_id}/results") as response:
                if not response.is_success:
                    response.read()
                    _check(response)
                for chunk in response.iter_bytes():
                    written += chunk.count(b"\n")
                    f.write(chunk)
        else:
            if not job_id.startswith("batch_"):
                raise CliError(f"{job_id}: --format openai needs a batch id (batch_...)")
            batch = api.sdk.batches.retrieve(job_id)
            if batch.status not in FINISHED:
                raise CliError(f"{job_id} is {batch.status}; its output files come at the end")
            for file_id in (batch.output_file_id, batch.error_file_id):
                if file_id:
                    with api.sdk.files.with_streaming_response.content(file_id) as response:
                        for chunk in response.iter_bytes():
                            written += chunk.count(b"\n")
                            f.write(chunk)
    out.print(f"{written} lines written to {output}", highlight=False)


@app.command()
def cancel(
    ctx: typer.Context,
    job_id: Annotated[str, typer.Argument(metavar="ID", help="A job or batch id.")],
) -> None:
    """Cancel a job or batch in progress."""
    api: Api = ctx.obj
    job = api.call("POST", f"/v1/jobs/{job_id}/cancel")
    out.print(f"{job_id}: {job['status']}", highlight=False)


# --- progress ---------------------------------------------------------------------------------


@app.command(
    name="gpu-check",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def gpu_check(ctx: typer.Context) -> None:
    """On a GPU host, from a checkout: the one-command GPU self-test (as `make gpu-check`;
    arguments go to scripts/gpu_check.py, e.g. --model Qwen/Qwen3-8B)."""
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    if not script.exists():
        raise CliError("gpu-check runs from a thinkbatch checkout: there, run `make gpu-check`")
    # The checkout's own script: it checks the host before anything is installed, then
    # installs and starts the stack, as make does.
    code = subprocess.call([sys.executable, str(script), *ctx.args])
    raise typer.Exit(code)


def _counts(job: dict[str, Any]) -> tuple[int, int, int]:
    c = job["counts"]
    failed = c["failed"] + c["cancelled"] + c["expired"]
    return c["succeeded"] + failed, failed, c["total"]


def _line(job_id: str, job: dict[str, Any], *, rate: float | None, eta: float | None) -> str:
    done, failed, total = _counts(job)
    u = job["usage"]
    text = f"{job_id}: {job['status']} {done}/{total} done, {failed} failed"
    if rate is not None:
        text += f", {rate:.0f} tok/s"
    if eta is not None:
        text += f", ETA {eta:.0f}s"
    if job["status"] in FINISHED:
        text += (
            f"; tokens: {u['prompt_tokens']} prompt, {u['completion_tokens']} completion "
            f"({u['reasoning_tokens']} reasoning)"
        )
        text += _thinking(job.get("stats"))
    return text


def _thinking(stats: dict[str, Any] | None) -> str:
    """The job's thinking statistics as one more line (empty when the job has none)."""
    if not stats or stats.get("reasoning_share") is None:
        return ""
    length, cut = stats["thinking_tokens"], stats["thinking_truncated"]
    text = f"\nthinking: {stats['reasoning_share']:.0%} of completion tokens"
    if length["items"]:
        text += (
            f"; {length['items']} items thought, tokens p50 {length['p50']}, "
            f"p90 {length['p90']}, max {length['max']}"
        )
    return text + (
        f"; truncated by budget {cut['by_budget']}, by max_tokens {cut['by_max_tokens']}"
    )


def _exit_code(job: dict[str, Any]) -> int:
    if job["status"] != "completed":
        return ENDED_BADLY
    return FAILED_ITEMS if _counts(job)[1] else OK


def _watch(api: Api, job_id: str, interval: float = 0.5) -> int:
    started = time.monotonic()
    job = api.call("GET", f"/v1/jobs/{job_id}")
    base_tokens, base_done = job["usage"]["completion_tokens"], _counts(job)[0]
    live = out.is_terminal
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TextColumn("failed {task.fields[failed]}"),
        TextColumn("{task.fields[rate]:.0f} tok/s"),
        TimeRemainingColumn(),
        console=out,
        disable=not live,
    )
    last_plain = 0.0
    with progress:
        task = progress.add_task(job_id, total=_counts(job)[2], failed=0, rate=0.0)
        while True:
            done, failed, total = _counts(job)
            elapsed = max(time.monotonic() - started, 1e-6)
            rate = (job["usage"]["completion_tokens"] - base_tokens) / elapsed
            progress.update(task, completed=done, total=total, failed=failed, rate=rate)
            if job["status"] in FINISHED:
                break
            if not live and time.monotonic() - last_plain >= 2:
                per_item = (done - base_done) / elapsed
                eta = (total - done) / per_item if per_item > 0 else None
                print(_line(job_id, job, rate=rate, eta=eta), flush=True)
                last_plain = time.monotonic()
            time.sleep(interval)
            job = api.call("GET", f"/v1/jobs/{job_id}")
    out.print(_line(job_id, job, rate=None, eta=None), highlight=False)
    return _exit_code(job)


app.add_typer(keys_cli.app, name="keys")


def run() -> None:
    """The entry point: errors as one line on stderr and exit code 1."""
    try:
        app()
    except (CliError, keys_cli.KeysError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(ERROR)
    except Exception as error:
        message = _client_error(error)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        sys.exit(ERROR)


def _client_error(error: Exception) -> str | None:
    """One line for an error of the API's transports (imported only if a command used them),
    or of the file system; None for anything else."""
    openai = sys.modules.get("openai")
    httpx = sys.modules.get("httpx")
    if openai is not None and isinstance(error, openai.APIStatusError):
        return f"HTTP {error.status_code} {error.message}"
    transports = tuple(
        t
        for t in (
            getattr(openai, "APIConnectionError", None),
            getattr(httpx, "TransportError", None),
        )
        if isinstance(t, type)
    )
    if transports and isinstance(error, transports):
        return f"cannot reach the API: {error}"
    if isinstance(error, OSError):
        return str(error)
    return None


if __name__ == "__main__":
    run()
