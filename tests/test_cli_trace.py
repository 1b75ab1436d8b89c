"""``tracestore trace``: one session's trace from the shell, against real servers."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from tracestore import TraceStore
from tracestore.cli import main
from tracestore.traces import node_id

P1 = "<|user|>2+2?<|end|><|assistant|>"
P2 = P1 + "4<|end|>" + "<|user|>x3?<|end|><|assistant|>"


def _chat(st: TraceStore, sid: str) -> None:
    """docs/traces.md's worked example: two turns and a retry of the second with another answer."""
    for prompt, response, delta, out, version in (
        (P1, "4<|end|>", [101, 102, 103], [52, 7], 3),
        (P2, "12<|end|>", [104, 105], [60, 7], 4),
        (P2, "13<|end|>", [], [61, 7], 5),
    ):
        m = st.lookup(sid, prompt)
        st.record_turn(sid, prompt, response, prefix=m, delta_token_ids=delta, response_token_ids=out,
                       response_logprobs=[-0.5] * len(out), version=version)


def _cli(url: str, run: str, *args: str) -> tuple[int, str]:
    r = CliRunner().invoke(main, ["trace", *args, "--url", url, "--run", run])
    return r.exit_code, r.output


@pytest.mark.parametrize("where", ["standalone", "cluster"])
def test_trace_prints_the_tree_json_and_a_nodes_training_trace(
    where: str, standalone_url: str, cluster_url: str, run_id: str
) -> None:
    url = standalone_url if where == "standalone" else cluster_url
    with TraceStore.connect(url, run=run_id) as st:
        _chat(st, "chat-1")
        code, out = _cli(url, run_id, "chat-1")
        assert code == 0, out
        lines = out.splitlines()
        assert lines[0].startswith("session 'chat-1'") and "5 nodes, 11 tokens (6 generated)" in lines[0]
        rows = [line.split() for line in lines[3:]]
        assert [r[:6] for r in rows] == [
            ["1", "-", "32", "3", "prompt", "3"],
            ["2", "1", "40", "2", "generated", "3"],
            ["3", "2", "71", "2", "prompt", "4"],
            ["4", "3", "80", "2", "generated", "4"],
            ["5", "3", "80", "2", "generated", "5"],
        ]
        assert out.count('"12<|end|>"') == 1 and '      "<|user|>x3?' in out  # indented by depth
        code, out = _cli(url, run_id, "chat-1", "--json")
        doc = orjson.loads(out)
        assert [n["id"] for n in doc["nodes"]] == [node_id(k) for k in (
            P1, P1 + "4<|end|>", P2, P2 + "12<|end|>", P2 + "13<|end|>")]
        assert doc["nodes"][4]["write_id"] != doc["nodes"][2]["write_id"] == doc["nodes"][3]["write_id"]
        assert len(doc["chain"]) == 16  # the index's: the chain of its writes' ids
        assert "".join(n["text"] for n in doc["nodes"][:3]) == P2
        # one node's training trace: by number (key rebuilt from the texts) or by its key
        code, by_num = _cli(url, run_id, "chat-1", "--node", "5", "--json")
        code2, by_key = _cli(url, run_id, "chat-1", "--export", P2 + "13<|end|>", "--json")
        assert code == code2 == 0 and orjson.loads(by_num) == orjson.loads(by_key)
        tr = orjson.loads(by_num)
        assert tr["input_ids"] == [101, 102, 103, 52, 7, 104, 105, 61, 7]
        assert tr["labels"] == [-100, -100, -100, 52, 7, -100, -100, 61, 7]
        code, out = _cli(url, run_id, "chat-1", "--node", "4")
        assert code == 0 and "[101, 102, 103, 52, 7, 104, 105, 60, 7]" in out


def test_trace_errors_a_person_can_act_on(standalone_url: str, run_id: str) -> None:
    with TraceStore.connect(standalone_url, run=run_id) as st:
        _chat(st, "chat-1")
        st.open_session("gone", "producer")
        _chat(st, "gone")
        st.release(["gone"], "producer")
        code, out = _cli(standalone_url, run_id, "nope")
        assert code == 0 and out.strip() == f"session 'nope' of run '{run_id}' has no trace data"
        code, out = _cli(standalone_url, run_id, "gone")
        assert code == 1 and out.startswith("error: SessionReleased") and out.count("\n") == 1
        code, out = _cli(standalone_url, run_id, "chat-1", "--node", "9")
        assert code == 1 and "has no node 9 (it has 5)" in out
        code, out = _cli(standalone_url, run_id, "chat-1", "--export", "zzz")
        assert code == 1 and out.startswith("error: PromptMismatch") and "nearest stored ends [32, 40, 71, 80]" in out
        code, out = _cli(standalone_url, run_id, "chat-1", "--node", "1", "--export", "x")
        assert code == 2 and "not both" in out
        # a damaged index (a record edited by hand): one line naming the node, not a wrong tree
        r: Any = st.redis
        idx = st.keys.idx("chat-1")
        rec = r.hget(idx, node_id(P2))
        r.hset(idx, node_id(P2), b"3.00000000,9," + rec.split(b",", 2)[2])  # parent number 9: no such node
        code, out = _cli(standalone_url, run_id, "chat-1")
        assert code == 1 and out.startswith("error: CorruptData") and "is not stored" in out
        code, out = _cli(standalone_url, run_id, "chat-1", "--node", "5")
        assert code == 1 and out.startswith("error: CorruptData")
    with TraceStore.connect(standalone_url, run=run_id + "nt", store_text=False) as nt:
        _chat(nt, "chat-1")
        code, out = _cli(standalone_url, run_id + "nt", "chat-1", "--node", "2")
        assert code == 1 and "no stored text" in out and "--export TEXT" in out
        code, out = _cli(standalone_url, run_id + "nt", "chat-1")
        assert code == 0 and out.splitlines()[3].split()[-1] == "-"  # no text column value


def test_trace_shows_why_a_node_forks(standalone_url: str, run_id: str) -> None:
    """The ``fork`` column (and ``fork`` in --json): the reason a writer gave, ``-`` elsewhere;
    a retry's answer beside the first is no fork."""
    with TraceStore.connect(standalone_url, run=run_id) as st:
        _chat(st, "chat-1")
        edited = P1 + "4<|end|>" + "<|user|>x4?<|end|><|assistant|>"
        m = st.lookup("chat-1", edited)
        assert m.extended
        st.record_turn("chat-1", edited, "16<|end|>", prefix=m, delta_token_ids=[104, 106], response_token_ids=[62, 7],
                       response_logprobs=[-0.5, -0.5], version=5, fork="client_edit")
        m = st.lookup("chat-1", P1 + "5<|end|>")
        st.record_turn("chat-1", P1 + "5<|end|>", "x", prefix=m, delta_token_ids=[53, 8], response_token_ids=[9],
                       response_logprobs=[-0.5], version=5, fork="template")
        code, out = _cli(standalone_url, run_id, "chat-1")
        assert code == 0, out
        lines = out.splitlines()
        assert lines[1].split()[:7] == ["num", "parent", "end", "tokens", "labels", "version", "fork"]
        forks = {r.split()[0]: r.split()[6] for r in lines[3:]}
        assert forks == {"1": "-", "2": "-", "3": "-", "4": "-", "5": "-", "6": "client_edit", "7": "-", "8": "template", "9": "-"}
        doc = orjson.loads(_cli(standalone_url, run_id, "chat-1", "--json")[1])
        assert [n["fork"] for n in doc["nodes"]].count(None) == 7
        assert {n["num"]: n["fork"] for n in doc["nodes"] if n["fork"]} == {6: "client_edit", 8: "template"}
