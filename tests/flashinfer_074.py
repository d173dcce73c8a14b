"""What a test needs from FlashInfer 0.7.4 (the test env's release): its protocol records.

``tox -e test`` pins ``flashinfer-python==0.7.4``, so there the protocol-record
API (``AutoTuner.publish_protocol_record`` / ``get_protocol_records``) is
always present. Elsewhere (the vllm env's 0.7.2.post1, a checkout with an
older FlashInfer) a test that needs it is skipped.

Invariant: CI never skips a 0.7.4 check silently. Under CI (``flashinfer_072.
under_ci``: ``CI`` set, as CI's machine sets it and ``tox -e test`` passes it
on) a missing API fails the test instead, as a missing 0.7.2 env does.
"""

from __future__ import annotations

import pytest
from flashinfer_072 import under_ci


def has_protocol_records() -> bool:
    """Whether the FlashInfer imported here publishes and reads protocol records."""
    from flashinfer.autotuner import AutoTuner

    return hasattr(AutoTuner, "publish_protocol_record") and hasattr(
        AutoTuner, "get_protocol_records"
    )


def require_protocol_records() -> None:
    """Return where FlashInfer has protocol records; otherwise skip, or under CI fail."""
    if has_protocol_records():
        return
    import flashinfer

    why = (
        f"FlashInfer {flashinfer.__version__} has no protocol records "
        "(publish_protocol_record); `tox -e test` runs these on FlashInfer 0.7.4"
    )
    if under_ci():
        pytest.fail(
            f"CI must run the FlashInfer 0.7.4 protocol-record checks: {why}", pytrace=False
        )
    pytest.skip(why)
