"""inv health's chat-completion verdict on real vLLM answers (tests/fixtures/real/vllm-api, captured from
the real engine in the lab): a healthy server passes whether its model stopped or ran out of tokens."""

from __future__ import annotations

from railyard.checks.probes import judge_answer
from tests.conftest import real


def _status(name: str) -> tuple[int, str]:
    body, code = real(f"vllm-api/{name}").rstrip("\n").rsplit("\n", 1)
    return int(code), body


def test_an_answer_cut_at_max_tokens_is_healthy_and_shows_what_the_model_said():
    ok, detail = judge_answer(200, real("vllm-api/chat-length-16.json"))
    assert ok, detail
    assert detail.startswith("HTTP 200; finish_reason length; 16 token(s)") and '"V V V' in detail


def test_an_answer_that_stopped_is_healthy():
    ok, detail = judge_answer(200, real("vllm-api/chat-stop-string.json"))
    assert ok and "finish_reason stop; 2 token(s)" in detail


def test_an_error_from_the_server_fails_with_its_message():
    for name, code_seen, words in (("chat-unknown-model.txt", 404, "does not exist"),
                                   ("chat-max-tokens-0.txt", 400, "max_tokens must be at least 1")):
        code, body = _status(name)
        assert code == code_seen
        ok, detail = judge_answer(code, body)
        assert not ok and detail.startswith(f"HTTP {code}") and words in detail


def test_no_generated_token_or_an_unknown_finish_is_not_a_pass():
    body = real("vllm-api/chat-length-16.json")
    ok, detail = judge_answer(200, body.replace('"completion_tokens":16', '"completion_tokens":0'))
    assert not ok and "no generated token" in detail
    ok, detail = judge_answer(200, body.replace('"finish_reason":"length"', '"finish_reason":"abort"'))
    assert not ok and "expected stop or length" in detail
    assert judge_answer(200, "<html>gateway</html>") == (False, "HTTP 200 but not a chat completion: <html>gateway</html>")
    assert judge_answer(None, "curl: (7) Failed to connect")[0] is False
