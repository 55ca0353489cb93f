"""bench/request_stages.py charges a request's CPU to the hook or view that spent it, counts no
waiting, and leaves what the app answers as it was."""

from __future__ import annotations

import time

from flask import Flask
from flask import Response

from bench.request_stages import RequestStages
from bench.request_stages import report
from tests.helpers import burn_cpu


def _app() -> Flask:
    app = Flask(__name__)

    @app.before_request
    def check() -> None:
        burn_cpu(0.03)

    @app.after_request
    def stamp(response: Response) -> Response:
        response.headers["X-Stamp"] = "1"
        return response

    @app.get("/wait")
    def wait() -> str:
        time.sleep(0.05)  # waiting, as on a database: no CPU
        return "waited"

    @app.get("/fail")
    def fail() -> str:
        raise ValueError("the view failed")

    return app


def test_cpu_goes_to_the_stage_that_spent_it_and_waiting_to_none() -> None:
    app = _app()
    stages = RequestStages(app)
    client = app.test_client()
    for _ in range(2):
        answer = client.get("/wait")
        assert answer.status_code == 200 and answer.text == "waited"
        assert answer.headers["X-Stamp"] == "1"
    cpu = stages.cpu()
    hook = cpu[f"before {__name__}._app.check"]
    assert 0.06 <= hook < 0.12, cpu
    assert cpu["view wait"] < 0.02, cpu
    assert f"after {__name__}._app.stamp" in cpu
    assert list(cpu) == sorted(cpu, key=lambda stage: -cpu[stage])
    stages.reset()
    assert stages.cpu() == {}


def test_a_failing_view_still_fails_and_is_charged() -> None:
    app = _app()
    stages = RequestStages(app)
    assert app.test_client().get("/fail").status_code == 500
    assert "view fail" in stages.cpu()


def test_the_report_adds_up_to_the_call() -> None:
    lines = report({"view a": 0.3, "before b": 0.1}, total_s=0.5, calls=1000)
    assert [line.split()[0] for line in lines] == ["300.0", "100.0", "100.0"]
    assert [line.split()[2] for line in lines] == ["60.0%", "20.0%", "20.0%"]
    assert lines[-1].endswith("rest (Werkzeug, routing, the test client)")
