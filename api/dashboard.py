"""The job dashboard: server-rendered pages (Jinja, no JS build step) at `/`.

Where keys are required (AUTH_REQUIRED), the login page takes an API key and keeps it in a
cookie that is HttpOnly (no script reads it), SameSite=Strict (no other site's page sends it),
Secure over HTTPS, and scoped to the dashboard's pages only (api.auth: `browser` routes read
it, JSON routes never do). The key never appears in a URL. Every page reads through the job
service's functions, which scope by the key's tenant.

Pages refresh themselves while something runs (a meta refresh: no script at all), and the
Content-Security-Policy allows no script, so an answer that holds HTML can only be text here
(Jinja escapes it as well).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any
from urllib.parse import urlsplit

from flask import Blueprint
from flask import Flask
from flask import Response
from flask import make_response
from flask import redirect
from flask import render_template
from flask import request
from flask import url_for
from werkzeug.exceptions import Forbidden

# flask's redirect() is typed as werkzeug's Response, of which flask's is a subclass.
from werkzeug.wrappers import Response as BaseResponse

from api.auth import KEY_COOKIE
from api.auth import MAX_KEY_CHARS
from api.auth import LoginRequired
from api.auth import browser
from api.auth import caller
from api.auth import public
from api.services import services
from thinkbatch.errors import NotFound
from thinkbatch.jobs import JobOut
from thinkbatch.jobs import parse_job_id
from thinkbatch.keys import verify_key

bp = Blueprint("dashboard", __name__, template_folder="templates")

JOBS_SHOWN = 50
ITEMS_SHOWN = 200
REFRESH_S = 3
RUNNING = ("queued", "running", "cancelling")
COOKIE_MAX_AGE_S = 8 * 3600
CSP = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)


def _elapsed_s(job: JobOut) -> float | None:
    if job.started_at is None:
        return None
    end = job.finished_at or datetime.now(job.started_at.tzinfo)
    return max((end - job.started_at).total_seconds(), 1e-3)


def _row(job: JobOut) -> dict[str, Any]:
    c = job.counts
    finished = c.succeeded + c.failed + c.cancelled + c.expired
    elapsed = _elapsed_s(job)
    return {
        "job": job,
        "finished": finished,
        "percent": round(100 * finished / c.total, 1) if c.total else 100.0,
        "items_per_s": round(finished / elapsed, 2) if elapsed else None,
        "tokens_per_s": round(job.usage.completion_tokens / elapsed, 1) if elapsed else None,
        "running": job.status in RUNNING,
    }


def _page(template: str, refresh: bool = False, status: int = 200, **context: Any) -> Response:
    response = make_response(
        render_template(
            template,
            refresh=REFRESH_S if refresh else None,
            auth=services().settings.auth_required,
            **context,
        ),
        status,
    )
    response.headers["Content-Security-Policy"] = CSP
    response.headers["Cache-Control"] = "no-store"
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


@bp.get("/")
@browser
def index() -> Response:
    svc = services()
    page = svc.jobs.page(caller(), after=None, limit=JOBS_SHOWN)
    rows = [_row(job) for job in page.data]
    return _page(
        "dashboard/index.html",
        refresh=any(r["running"] for r in rows),
        rows=rows,
        models=svc.jobs.models_view(),
        tenant=caller().tenant,
    )


@bp.get("/jobs/<job_id>")
@browser
def job_page(job_id: str) -> Response:
    svc = services()
    key = parse_job_id(job_id)
    job = svc.jobs.status(caller(), key)  # with the models it waits for
    items = svc.jobs.items(caller(), key, limit=ITEMS_SHOWN)
    row = _row(job)
    return _page(
        "dashboard/job.html", refresh=row["running"], row=row, items=items, shown=ITEMS_SHOWN
    )


@bp.get("/jobs/<job_id>/timeline")
@browser
def timeline(job_id: str) -> Response:
    svc = services()
    key = parse_job_id(job_id)
    job = svc.jobs.status(caller(), key)  # scopes by tenant
    times = svc.jobs.finished_times(caller(), key)
    row = _row(job)
    return _page("dashboard/timeline.html", refresh=row["running"], row=row, plot=plot(job, times))


def plot(job: JobOut, times: list[datetime], width: int = 640, height: int = 240) -> dict[str, Any]:
    """A step line of items finished over time, as SVG coordinates (drawn by the template)."""
    pad = 40
    start = job.started_at or job.created_at
    span = max(((times[-1] - start).total_seconds() if times else 0.0), 1.0)
    total = max(job.counts.total, 1)
    points: list[tuple[float, float]] = [(pad, height - pad)]
    for n, t in enumerate(times, start=1):
        x = pad + (width - 2 * pad) * max((t - start).total_seconds(), 0.0) / span
        y = height - pad - (height - 2 * pad) * n / total
        points.append((round(x, 1), round(y, 1)))
    return {
        "width": width,
        "height": height,
        "pad": pad,
        "points": " ".join(f"{x},{y}" for x, y in points),
        "span_s": round(span, 1),
        "total": job.counts.total,
        "finished": len(times),
    }


@bp.get("/login")
@public
def login_form() -> Response:
    return _page("dashboard/login.html", error=None)


def _same_origin() -> None:
    """The forms post only from this site's own pages. A browser names the page a POST comes
    from (Origin, else Referer): another site's page must not sign a visitor in to the
    attacker's tenant, or out (login CSRF); SameSite cookies do not stop a cross-site response
    from setting one."""
    source = request.headers.get("Origin") or request.headers.get("Referer")
    if source is None:
        return  # not a browser's cross-site form: those always say where they come from
    if urlsplit(source).netloc != request.host:
        raise Forbidden("this form posts only from this site's own pages")


@bp.post("/login")
@public
def login() -> BaseResponse:
    _same_origin()
    svc = services()
    key = (request.form.get("key") or "").strip()
    limiter = svc_limiter()
    address = request.remote_addr or "unknown"
    limiter.check(address)
    found = None
    if key and len(key) <= MAX_KEY_CHARS:
        with svc.read_sessions() as session:
            found = verify_key(session, key)
    if found is None:
        limiter.failed(address)
        return _page("dashboard/login.html", status=400, error="That key is not valid.")
    response = redirect(url_for("dashboard.index"), 303)
    response.set_cookie(
        KEY_COOKIE,
        key,
        max_age=COOKIE_MAX_AGE_S,
        httponly=True,
        samesite="Strict",
        secure=request.is_secure,
        path="/",
    )
    return response


@bp.post("/logout")
@public
def logout() -> BaseResponse:
    _same_origin()
    response = redirect(url_for("dashboard.login_form"), 303)
    response.delete_cookie(KEY_COOKIE, path="/", httponly=True, samesite="Strict")
    return response


def svc_limiter() -> Any:
    from flask import current_app

    return current_app.extensions["thinkbatch_auth"]


@bp.errorhandler(NotFound)
def not_found(error: NotFound) -> Response:
    """A page, not the JSON API's envelope: the dashboard is read in a browser. Another
    tenant's job is "no such job" too, as in the API."""
    raw = error.ident
    shown = raw if len(raw) <= 64 else raw[:64] + "..."  # a path can be kilobytes long
    return _page("dashboard/not_found.html", status=404, shown=shown)


def init_app(app: Flask) -> None:
    @app.errorhandler(LoginRequired)
    def to_login(_: LoginRequired) -> BaseResponse:
        return redirect(url_for("dashboard.login_form"), 303)

    app.register_blueprint(bp)
