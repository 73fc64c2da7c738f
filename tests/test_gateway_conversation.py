"""The gateway's token-exact core on SmolLM2's real chat template: a conversation
sent back as text keeps the sampled tokens as they were, only the new suffix is
tokenized, and a history edit is a branch that drops the abandoned turns."""

from __future__ import annotations

import numpy as np
import pytest

from areno.gateway.conversation import AgentTrajectory, ChatRenderer, common_prefix, normalize

CALL = '<tool_call>\n{"name":"add","arguments":{"b":3,"a":2}}\n</tool_call>'  # as sampled: no spaces, b first


@pytest.fixture(scope="module")
def tok(smol_tokenizer_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_tokenizer_path)


def _sampled(tok, text: str, stop: bool = True) -> np.ndarray:
    ids = tok(text, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if stop else [])
    return np.array(ids, np.int32)


def _reply(args: str = '{"a": 2, "b": 3}') -> dict:
    # what the gateway answered: the parser's JSON, spaced and ordered its own way
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": args}}]}


def _start(tok):
    tr = AgentTrajectory(ChatRenderer(tok))
    msgs = [{"role": "system", "content": "You can add."}, {"role": "user", "content": "2+3?"}]
    tr.request(msgs, None)
    return tr, msgs


def test_a_tool_call_turn_keeps_its_sampled_tokens_and_only_the_result_is_tokenized(tok):
    tr, msgs = _start(tok)
    sampled = _sampled(tok, CALL)
    tr.answer(msgs, None, _reply(), sampled, np.full(sampled.size, -0.5, np.float32), stopped=True)
    # the agent sends it back as the client serialized it: other id, other JSON spacing
    back = msgs + [_reply('{"b":3, "a":2}') | {"tool_calls": [{"id": "x", "type": "function", "function": {
        "name": "add", "arguments": '{"b":3, "a":2}'}}]}, {"role": "tool", "tool_call_id": "x", "content": "5"}]
    ext = tr.request(back, None)
    assert not ext.branched and tr.branches == 0
    # the stopped turn sampled <|im_end|>: the observation starts right after it
    assert tok.decode(ext.observation) == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"
    ids, lps, mask = tr.arrays()
    assert ids[:sampled.size].tolist() == sampled.tolist() and (mask[:sampled.size] == 1).all()
    assert (mask[sampled.size:] == 0).all() and (lps[sampled.size:] == 0).all()
    assert ids[sampled.size:].tolist() == ext.observation.tolist()
    # the context the next turn is sampled from: the first rendered prompt, then exactly these
    assert tr.context().tolist() == tr.base.tolist() + ids.tolist()
    # re-rendering the whole conversation would not give the sampled tokens (the drift this avoids)
    rendered = ChatRenderer(tok).render(back, None, generation_prompt=True)
    assert tok(rendered, add_special_tokens=False)["input_ids"] != tr.context().tolist()


def test_a_turn_cut_at_its_token_cap_gets_the_templates_end_marker_as_observation(tok):
    tr, msgs = _start(tok)
    sampled = _sampled(tok, "Let me think", stop=False)
    reply = {"role": "assistant", "content": "Let me think"}
    tr.answer(msgs, None, reply, sampled, np.zeros(sampled.size, np.float32), stopped=False)
    ext = tr.request(msgs + [reply, {"role": "user", "content": "Go on."}], None)
    assert tok.decode(ext.observation).startswith("<|im_end|>\n<|im_start|>user\nGo on.")


def test_a_history_edit_branches_back_to_the_deepest_call_it_still_extends(tok):
    tr, msgs = _start(tok)
    conv = list(msgs)
    for k in range(3):  # three turns, each answered by a tool result
        s = _sampled(tok, f"turn {k}")
        reply = {"role": "assistant", "content": f"turn {k}"}
        tr.answer(conv, None, reply, s, np.zeros(s.size, np.float32), stopped=True)
        conv = conv + [reply, {"role": "tool", "content": str(k)}]
        if k < 2:
            assert not tr.request(conv, None).branched
    # the agent edits turn 1's result and goes on from there: turn 2 is abandoned
    edited = conv[:4] + [conv[4] | {"content": "turn 1"}, {"role": "tool", "content": "edited"}]
    ext = tr.request(edited, None)
    assert ext.branched and ext.dropped_turns == 1 and tr.branches == 1 and tr.turns == 2
    text = tok.decode(tr.context())
    assert "turn 2" not in text and text.endswith("<|im_start|>tool\nedited<|im_end|>\n<|im_start|>assistant\n")
    # a conversation that keeps nothing of the first call (its system turn rewritten) rebases:
    # rendered whole into the base, nothing of it trained
    ext = tr.request([{"role": "system", "content": "Other."}] + edited[1:], None)
    assert ext.rebased and tr.turns == 0 and tr.arrays()[0].size == 0 and tr.branches == 2


def test_changed_tools_are_a_branch(tok):
    tr, msgs = _start(tok)
    s = _sampled(tok, "ok")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    tr.answer(msgs, None, {"role": "assistant", "content": "ok"}, s, np.zeros(s.size, np.float32), True)
    ext = tr.request(msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "?"}], tools)
    assert ext.rebased and tr.turns == 0


def test_completions_extend_by_text_and_branch_otherwise(tok):
    tr = AgentTrajectory(ChatRenderer(tok))
    tr.request_text("Q: 2+3=")
    s = _sampled(tok, " 5", stop=False)
    tr.answer_text("Q: 2+3=", " 5", s, np.zeros(s.size, np.float32))
    ext = tr.request_text("Q: 2+3= 5\nQ: 1+1=")
    assert not ext.branched and tok.decode(ext.observation) == "\nQ: 1+1="
    assert tr.request_text("Q: 2+4=").rebased


def test_normalize_ignores_ids_spacing_and_absent_fields():
    a = [{"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1, "y": 2}'}}]}]
    b = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "2", "type": "function", "function": {"name": "f", "arguments": '{"y":2,"x":1}'}}]}]
    assert normalize(a) == normalize(b)
    assert normalize(a) != normalize([b[0] | {"content": "x"}])


def test_common_prefix():
    rows = [np.array([1, 2, 3, 4]), np.array([1, 2, 5]), np.array([1, 2, 3])]
    assert common_prefix(rows) == 2 and common_prefix(rows[::2]) == 3 and common_prefix([]) == 0


def test_a_groups_prompt_is_the_prefix_its_runs_share_and_a_run_off_it_is_not_trained():
    from areno.gateway.driver import trajectories_batch

    def run(base, turn):
        t = AgentTrajectory(renderer=None)  # type: ignore[arg-type]  # the arrays only
        t.base = np.array(base, np.int32)
        t._append(np.array(turn, np.int32), np.full(len(turn), -1.0, np.float32), 1)
        return t

    runs = [run([1, 2, 3, 4], [9]), run([1, 2, 5], [8, 8]), run([7, 2], [6])]
    batch, exact = trajectories_batch(runs, np.array([0, 0, 0]),
                                      np.zeros(3, np.uint8), np.zeros(3, bool))
    assert batch.prompt_tokens(0).tolist() == [1] and exact.tolist() == [True, True, False]
    batch, exact = trajectories_batch(runs[:2], np.array([0, 0]), np.zeros(2, np.uint8), np.zeros(2, bool))
    assert batch.prompt_tokens(0).tolist() == [1, 2] and exact.all()
    # the rest of each base leads its response, untrained; then the sampled turn, trained
    assert batch.response_tokens(0).tolist() == [3, 4, 9] and batch.response_tokens(1).tolist() == [5, 8, 8]
    assert batch.response_mask.tolist() == [0, 0, 1, 0, 1, 1]
    assert batch.response_logprobs.tolist() == [0, 0, -1, 0, -1, -1]
