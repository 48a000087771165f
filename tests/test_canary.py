"""`inv health --canary`: each target's answers to the fixed prompts against the record, on scripted
sessions (the answers are vLLM's chat completion shape, tests/fixtures/real/vllm-api). What this proves is
railyard's judgment: a differing answer asked again before it fails, the failing target named with the
prompt and both answers, no record or a record of another deployment judged as such, never as the
engines' fault. The real engine's answers (another seed of the lab model answering otherwise) are the
lab's: test_lab_real_replicas.py."""

from __future__ import annotations

import json
import re

from railyard.checks import FAIL, PASS, WARN
from railyard.inventory import Host
from railyard.plan import layout as layouts
from railyard.plan.spec import Endpoint, LaunchPlan
from railyard.testing import FakeSession
from railyard.verbs import canary

R0 = Endpoint("r0", "A", "127.0.0.1", 8001, "", "railyard-lab/tiny-qwen3")
R1 = Endpoint("r1", "A", "127.0.0.1", 8002, "", "railyard-lab/tiny-qwen3")
RIGHT = ["the bank of the old mill", "red, green and blue", "copper lantern orbit"]
WRONG = "vowel summit quartz marble"


def completion(text: str) -> str:
    return json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "model": "railyard-lab/tiny-qwen3",
                       "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                    "finish_reason": "length"}],
                       "usage": {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}})


def session(by_port: dict[int, list[str | None]]) -> FakeSession:
    """Each port answers its list in turn (None: no answer); the prompt picks nothing, the order does."""
    queues = {p: iter(a) for p, a in by_port.items()}

    def reply(script: str):
        port = int(re.search(r"127\.0\.0\.1:(\d+)/v1/chat/completions", script).group(1))
        got = next(queues[port])
        if got is None:
            return 28, "\n@@000 120.0 ", "curl: (28) Operation timed out after 120001 milliseconds with 0 bytes received"
        return 0, completion(got) + "\n@@200 0.05 ", ""
    return FakeSession(Host("A", 0, "198.18.0.11", 22, "root", "ssh", "", {}, {})).on(
        re.compile(r"/v1/chat/completions"), reply).on(re.compile(r"canary\.json.*mv -f"), (0, ""))


class Runner:
    def __init__(self, s: FakeSession):
        self.s = s

    def session(self, host):
        return self.s


def test_an_engine_that_gives_the_recorded_answers_passes_on_one_ask_each():
    s = session({8001: list(RIGHT)})
    v = canary.judge(R0, RIGHT, lambda p: canary.ask(s, R0, p))
    assert v.status == PASS and v.detail == "r0: the 3 canary answers are the recorded ones"
    bodies = [c for c in s.calls if "/v1/chat/completions" in c]
    assert len(bodies) == 3


def test_an_answer_that_differs_three_times_fails_naming_the_target_the_prompt_and_both_answers():
    s = session({8002: [RIGHT[0], WRONG, WRONG, WRONG]})
    v = canary.judge(R1, RIGHT, lambda p: canary.ask(s, R1, p))
    assert v.status == FAIL
    assert v.detail == (f"r1: the answer to canary prompt 2 ({canary.PROMPTS[1]!r}) differs from the record in 3 asks "
                        f"of 3: \"{WRONG}\", recorded \"{RIGHT[1]}\"")


def test_an_answer_that_differs_once_then_matches_passes():
    """Greedy decoding can differ with the batch it runs in: one differing answer is no verdict."""
    s = session({8001: [RIGHT[0], WRONG, RIGHT[1], RIGHT[2]]})
    assert canary.judge(R0, RIGHT, lambda p: canary.ask(s, R0, p)).status == PASS


def test_no_answer_fails_with_curls_words():
    s = session({8001: [None]})
    v = canary.judge(R0, RIGHT, lambda p: canary.ask(s, R0, p))
    assert v.status == FAIL and v.detail.startswith("r0: no answer to canary prompt 1: no answer: curl: (28)")


def _plan(layout="replicas") -> LaunchPlan:
    return LaunchPlan("vllm-replicas", layout, (), R0)


class Inv:
    def __init__(self, revision="a" * 40):
        self.head = Host("A", 0, "198.18.0.11", 22, "root", "ssh", "", {},
                         {"model_path": "~/models/tiny-qwen3", "model_revision": revision})


def _record(targets, revision="a" * 40) -> dict:
    return canary.identity(Inv(revision), _plan(), targets) | {"prompts": list(canary.PROMPTS),
                                                               "answers": {t.service: RIGHT for t in targets}}


def test_check_fails_the_wrong_replica_alone():
    s = session({8001: list(RIGHT), 8002: [WRONG] * 3})
    got = canary.check(Inv(), _plan(), Runner(s), [R0, R1], _record([R0, R1]), "A:~/.cache/x/canary.json")
    assert [(v.target, v.status) for v in got] == [("r0", PASS), ("r1", FAIL)]


def test_no_record_fails_the_canary_not_an_engine_and_another_revision_invalidates_it():
    s = session({})
    none = canary.check(Inv(), _plan(), Runner(s), [R0], None, "A:~/.cache/x/canary.json")
    assert [(v.target, v.status) for v in none] == [("-", FAIL)]
    assert none[0].detail.startswith("no canary record at A:~/.cache/x/canary.json")
    old = canary.check(Inv("b" * 40), _plan(), Runner(s), [R0], _record([R0]), "A:f")
    assert [(v.target, v.status) for v in old] == [("-", WARN)]
    assert f"model_revision '{'a' * 40}' -> '{'b' * 40}'" in old[0].detail and "invalidated, not judged" in old[0].detail
    more = canary.check(Inv(), _plan(), Runner(s), [R0, R1], _record([R0]), "A:f")
    assert more[0].status == WARN and "targets ['r0'] -> ['r0', 'r1']" in more[0].detail
    assert not [c for c in s.calls if "/v1/chat/completions" in c]   # no engine was asked


def test_record_keeps_every_targets_answers_and_nothing_when_one_gives_none():
    s = session({8001: list(RIGHT), 8002: list(RIGHT)})
    got = canary.record(Inv(), _plan(), Runner(s), [R0, R1], s, "/root/.cache/railyard/serve/vllm-replicas/canary.json")
    assert [v.status for v in got] == [PASS, PASS]
    written = [c for c in s.calls if "canary.json" in c]
    assert len(written) == 1 and "mv -f" in written[0]
    s2 = session({8001: list(RIGHT), 8002: [None, None, None]})
    got = canary.record(Inv(), _plan(), Runner(s2), [R0, R1], s2, "/root/x/canary.json")
    assert [v.status for v in got] == [PASS, FAIL] and not [c for c in s2.calls if "canary.json" in c]


def test_a_canary_value_other_than_record_is_a_usage_error_before_any_host(tmp_path):
    import subprocess
    import sys
    from .conftest import ROOT
    r = subprocess.run([sys.executable, "-m", "invoke", "health", "--canary", "again", "-i", str(tmp_path / "none.yml")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == ("error: --canary again: `--canary` judges the answers against the record, "
                                "`--canary record` keeps them")


class Recording(FakeSession):
    """A FakeSession that keeps each request's JSON body (request() sends it on stdin)."""

    def __init__(self, host, rules=None):
        super().__init__(host, rules)
        self.bodies: list[dict | None] = []

    def run(self, command, timeout=None, stdin=None, on_output=None):
        self.bodies.append(json.loads(stdin) if stdin else None)
        return super().run(command, timeout, stdin, on_output)


def test_pd_asks_every_prefill_decode_pair_as_the_proxy_does_then_the_proxy():
    """The reference topology (four prefill instances, one decode): four pairs and the proxy. A pair's
    prefill request asks vLLM to keep the KV for a remote decode and stop after one token; its
    kv_transfer_params (here the lab stand-in's shape, which is vLLM 0.32's) go to the decode request
    unchanged, both under one X-Request-Id, from the proxy's host."""
    from .test_pd_plan import pd_plan
    _, plan = pd_plan()
    targets = layouts.by_name("pd").canary_targets(plan)
    assert [t.service for t in targets] == [f"prefill-{i}>decode-0" for i in range(4)] + ["proxy"]
    pair = targets[2]
    assert pair.host == "P1" and pair.model == plan.endpoint.model
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [7, 8],
              "remote_engine_id": "e1", "remote_request_id": "chatcmpl-x", "remote_host": "192.168.120.12",
              "remote_port": 5608, "tp_size": 4}
    pre, dec = pair.prefill, pair.decode

    def reply(script: str):
        if f"{pre.bind}:{pre.port}/" in script:
            return 0, json.dumps(json.loads(completion("The")) | {"kv_transfer_params": params}) + "\n@@200 0.05 ", ""
        assert f"{dec.bind}:{dec.port}/" in script
        return 0, completion(RIGHT[0]) + "\n@@200 0.05 ", ""
    s = Recording(Host("P1", 0, "198.18.0.11", 22, "root", "ssh", "", {}, {})).on(
        re.compile(r"/v1/chat/completions"), reply)
    assert canary.ask(s, pair, canary.PROMPTS[0]) == (RIGHT[0], "")
    first, second = s.bodies
    assert first["max_tokens"] == 1 and first["kv_transfer_params"]["do_remote_decode"] is True
    assert second["kv_transfer_params"] == params and second["max_tokens"] == canary.MAX_TOKENS
    assert first["messages"] == second["messages"] and first["temperature"] == 0 == second["temperature"]
    ids = [re.search(r"X-Request-Id: (railyard-canary-\w+)", c).group(1) for c in s.calls]
    assert len(ids) == 2 and ids[0] == ids[1]


def test_a_prefill_that_keeps_no_kv_for_the_pair_is_no_answer_naming_it():
    from .test_pd_plan import pd_plan
    _, plan = pd_plan()
    pair = layouts.by_name("pd").canary_targets(plan)[0]
    s = FakeSession(Host("P1", 0, "198.18.0.11", 22, "root", "ssh", "", {}, {})).on(
        re.compile(r"/v1/chat/completions"), (0, completion("The") + "\n@@200 0.05 "))
    v = canary.judge(pair, RIGHT, lambda p: canary.ask(s, pair, p))
    assert v.status == FAIL and v.target == "prefill-0>decode-0"
    assert v.detail.startswith("prefill-0>decode-0: no answer to canary prompt 1: no answer: prefill-0 (prefill) "
                               "answered without kv_transfer_params: {")
    assert len(s.calls) == 1   # the decode side was not asked


def test_a_launch_records_the_canary_once_and_a_relaunch_keeps_the_record_of_the_same_deployment():
    s = session({8001: list(RIGHT), 8002: list(RIGHT)})
    path = "/root/.cache/railyard/serve/vllm-replicas/canary.json"
    s.on(re.compile(r"canary\.json"), lambda c: (0, "") if "mv -f" in c else (1, ""))   # no record yet
    line = canary.at_launch(Inv(), _plan(), Runner(s), [R0, R1], s, path, f"A:{path}")
    assert line == f"canary: 3 answers of r0, r1 recorded at A:{path} (inv health --canary judges against them)"
    assert len([c for c in s.calls if "mv -f" in c]) == 1
    kept = FakeSession(Host("A", 0, "198.18.0.11", 22, "root", "ssh", "", {}, {})).on(
        re.compile(r"canary\.json"), (0, json.dumps(_record([R0, R1]))))
    line = canary.at_launch(Inv(), _plan(), Runner(kept), [R0, R1], kept, path, "A:x")
    assert line == "canary: the record at A:x is of this deployment: kept (inv health --canary judges against it)"
    assert not [c for c in kept.calls if "/v1/chat/completions" in c or "mv -f" in c]   # nothing asked or written


def test_a_launch_whose_engine_does_not_answer_the_canary_records_nothing_and_says_so():
    s = session({8001: list(RIGHT), 8002: [None, None, None]})
    s.on(re.compile(r"canary\.json"), lambda c: (0, "") if "mv -f" in c else (0, json.dumps(_record([R0], "b" * 40))))
    line = canary.at_launch(Inv(), _plan(), Runner(s), [R0, R1], s, "/root/x/canary.json", "A:x")
    assert line.startswith("canary: not recorded (r1: no answer to canary prompt 1: no answer: curl: (28)")
    assert line.endswith("record it once it answers: inv health --canary record")
    assert not [c for c in s.calls if "mv -f" in c]
