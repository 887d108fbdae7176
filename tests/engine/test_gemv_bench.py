"""`moetray bench gemv` on a few small matrices: each form measured at every rows count, ratios
against the same run's read bandwidth and one-row time, and a receipt the tables read."""

from __future__ import annotations

import json

from moetray.engine.bench import gemv
from moetray.engine.models import few_rows


def test_gemv_bench_measures_each_form_and_writes_its_receipt(tmp_path, monkeypatch):
    """Prevents: a form or a rows count left out, a ratio taken against another run's numbers, or a
    receipt the tables cannot render."""
    monkeypatch.setenv("MOETRAY_BENCH_DIR", str(tmp_path))
    assert gemv.main(["--out-features", "64", "--in-features", "128", "--stream-mib", "1", "--rows", "1,2",
                      "--threads", "1", "--repeats", "1", "--receipt", "gemv-test"]) == 0
    receipt = json.loads((tmp_path / "gemv-test.json").read_text())
    rows = receipt["results"]["1"]["rows"]
    forms = set(gemv.FORMS) if few_rows.refusal() is None else set(gemv.FORMS[:2])
    assert {(r["form"], r["rows"]) for r in rows} == {(f, m) for f in forms for m in (1, 2)}
    read = receipt["results"]["1"]["read_gbs"]
    for r in rows:
        assert r["us_per_matrix"] > 0
        assert r["x_read_bandwidth"] == r["weight_gbs"] / read
        if r["rows"] == 1:
            assert r["x_first_rows_time"] == 1.0
    assert len(receipt["table"]["rows"]) == len(rows)
