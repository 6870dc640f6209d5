"""How a request's end maps to an HTTP answer: a refused request is a 400, a failure inside the runtime a 500
(the other requests go on), a client's own abort no error at all."""

import msgspec
import pytest

from radixrt.protocol.messages import FinishReason, ReqDelta, StrDelta
from radixrt.client import Handle, ThreadWaker, raise_for_failures
from radixrt.protocol.errors import RequestError, RequestFailed
from radixrt.response import ResponseBuilder


def finished_state(reason: dict) -> Handle:
    state = Handle("r1", ResponseBuilder("r1"), ThreadWaker(), 0)
    finish = msgspec.convert(reason, FinishReason)  # SGLang's wire dict, as the scheduler's typed reason
    state.builder.add(StrDelta(rid="r1", text="", delta=ReqDelta(rid="r1", new_ids=[], finish_reason=finish)))
    return state


def test_a_runtime_failure_is_a_500():
    state = finished_state({"type": "abort", "message": "internal error while sampling: boom", "status_code": 500})
    assert state.server_error() and state.request_error() is None
    with pytest.raises(RequestFailed, match="boom"):
        raise_for_failures([state])


@pytest.mark.parametrize("reason", [{"type": "abort", "message": "invalid grammar: x", "status_code": 400},
                                    {"type": "abort", "message": "invalid grammar: x"}])
def test_a_refused_request_is_a_400(reason):
    with pytest.raises(RequestError, match="invalid grammar"):
        raise_for_failures([finished_state(reason)])


def test_a_client_abort_is_no_error():
    raise_for_failures([finished_state({"type": "abort", "message": "aborted", "status_code": 499})])
    raise_for_failures([finished_state({"type": "length", "matched": None})])
