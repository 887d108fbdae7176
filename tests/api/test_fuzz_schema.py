"""The OpenAPI schema is the truth: schemathesis, every check on, against a live engine (bounded).

``moetray bench fuzz`` runs the same thing for ≥ 3,000 cases and writes a receipt; here a few
cases per operation keep CI short while still walking every operation through every phase.
"""

from __future__ import annotations

import httpx
from engine_harness import ADMIN_TOKEN

from moetray.engine.bench.fuzz import run_schemathesis, summary


def test_schemathesis_finds_no_failure_of_any_check(tiny_qwen3, start_engine, tmp_path):
    engine = start_engine(tiny_qwen3, kv_tokens=256, test_hooks=False)
    report = run_schemathesis(engine.url, ADMIN_TOKEN, max_examples=12, seed=7, workdir=tmp_path / "st")
    numbers = summary(report)
    assert numbers["operations"]["tested"] >= 8, numbers
    assert numbers["generated"] >= 100, numbers
    assert numbers["failures"] == [] and numbers["errored"] == 0, report["output"][-6000:]
    assert httpx.get(f"{engine.url}/health").json()["state"] == "serving"


def test_the_schema_documents_every_status_and_hides_test_fields(live):
    """Every operation lists its errors with the one error schema; streams say text/event-stream."""
    schema = httpx.get(f"{live.url}/openapi.json").json()
    chat = schema["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "403", "409", "413", "415", "500", "503"} <= set(chat)
    assert "422" not in chat
    assert "text/event-stream" in chat["200"]["content"]
    ref = chat["413"]["content"]["application/json"]["schema"]["$ref"]
    assert ref == "#/components/schemas/ErrorResponse"
    events = schema["paths"]["/admin/events"]["get"]["responses"]["200"]["content"]
    assert list(events) == ["text/event-stream"]
    assert "401" in schema["paths"]["/admin/status"]["get"]["responses"]
    assert "404" in schema["paths"]["/admin/requests/{request_id}/cancel"]["post"]["responses"]
    assert "moetray_test_" not in httpx.get(f"{live.url}/openapi.json").text
