"""Rules of the HTTP contract shared by the engine (writer) and the tray (reader)."""

import pytest

from moetray.policy.wire import REFUSALS, ROUTES, Retry, error_body, refusal_for, route_path


def test_route_placeholders_are_filled():
    # A client that sent the template literally would hit a 404 on every cancel.
    assert route_path("cancel", request_id="abc") == "/admin/requests/abc/cancel"


def test_only_health_is_unauthenticated():
    # Admin routes without the token would let any local page drive the engine.
    open_routes = {name for name, route in ROUTES.items() if route.auth == "none"}
    assert open_routes == {"health"}
    assert all(r.auth == "admin" for r in ROUTES.values() if r.path.startswith("/admin/"))


def test_unknown_kind_is_an_internal_error_that_never_retries():
    # Guessing a friendly status for an unmapped refusal would hide the bug.
    refusal = refusal_for("no-such-kind")
    assert (refusal.status, refusal.retry) == (500, Retry.NEVER)


def test_every_refusal_says_which_kind_of_no():
    for kind, refusal in REFUSALS.items():
        assert 400 <= refusal.status < 600, kind
        assert refusal.summary.endswith("."), kind
    # Transient refusals are 409/5xx, never a 4xx that a client would treat as its fault.
    assert all(r.status in (409, 500, 503) for r in REFUSALS.values() if r.retry is Retry.NOW)


def test_error_body_is_openai_shaped_with_retry_class():
    body = error_body("rebuilding", "server unavailable: engine is rebuilding")
    assert body == {"error": {"message": "server unavailable: engine is rebuilding",
                              "type": "server_error", "param": None, "code": "rebuilding",
                              "kind": "rebuilding", "retry": "now"}}


@pytest.mark.parametrize(("kind", "openai_type", "code"), [
    ("invalid_request_error", "invalid_request_error", None),
    ("context_length_exceeded", "invalid_request_error", "context_length_exceeded"),
    ("unauthorized", "authentication_error", "unauthorized"),
    ("forbidden_host", "permission_error", "forbidden_host"),
    ("not_found", "not_found_error", "not_found"),
    ("busy", "invalid_request_error", "busy"),
    ("rebuild_latched", "server_error", "rebuild_latched"),
])
def test_error_type_follows_the_status_and_code_names_the_kind(kind, openai_type, code):
    """OpenAI clients pick their exception from the status, then ``code`` (a string or null);
    ``type`` is OpenAI's class, never moetray's kind (which travels as ``kind``)."""
    error = error_body(kind, "m", param="x")["error"]
    assert (error["type"], error["code"], error["kind"], error["param"]) == (openai_type, code, kind, "x")


def _interrupted_class_body() -> None:
    """A Stop landing in a class body's ``__set_name__``, as Python raises it."""

    class Descriptor:
        def __set_name__(self, owner, name):
            raise KeyboardInterrupt

    class Owner:  # noqa: F841 - defining it is the point
        attr = Descriptor()


def test_a_stop_is_known_through_the_error_a_class_body_wraps_it_in():
    from moetray.policy.wire import is_a_stop

    with pytest.raises(BaseException) as caught:
        _interrupted_class_body()
    assert is_a_stop(caught.value) and is_a_stop(KeyboardInterrupt())
    assert not is_a_stop(RuntimeError("a real failure")) and not is_a_stop(SystemExit(2))
