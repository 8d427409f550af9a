"""Tokenizers, chat templates, tool calls and the chat adapter on a byte-level BPE trained on
text the project generates (code-repair prompts, tool calls and tool outputs)."""

import json

import numpy as np
import pytest
from transformers import AutoTokenizer

from agentrl_jax.envs.coderepair import CodeRepairEnv, ExpertPolicy, make_task
from agentrl_jax.envs.coderepair.text import TOOL_SPECS, call_from_words, call_words
from agentrl_jax.hf.chat_env import ChatEnv, ChatExpertPolicy
from agentrl_jax.hf.tiny import make_tiny_tokenizer
from agentrl_jax.hf.tokenizer import load_tokenizer
from agentrl_jax.hf.tool_calls import (
    HarmonyToolCalls,
    ParsedCall,
    QwenToolCalls,
    check_call,
)

FAMILIES = {"qwen": "qwen3", "harmony": "gpt_oss", "chatml": "llama"}
TASKS = [make_task(seed, 1) for seed in range(6)]


def corpus():
    """Prompts, tool calls in both formats, tool outputs and schemas of a few tasks."""
    texts = [json.dumps([s.as_json() for s in TOOL_SPECS])]
    for task in TASKS:
        env = CodeRepairEnv()
        system, user = env.reset_text(task)
        texts += [system, user]
        for words in ExpertPolicy(task).plan:
            name, args = call_from_words(words)
            texts += [QwenToolCalls().render_call(name, args), json.dumps(args)]
            obs, res = env.step_call(name, args)
            texts.append(obs)
            if res.done:
                break
    return texts


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    texts = corpus()
    out = {}
    for fmt, family in FAMILIES.items():
        path = str(tmp_path_factory.mktemp(fmt))
        make_tiny_tokenizer(path, family, texts, vocab_size=600)
        out[fmt] = (path, load_tokenizer(path))
    return out


def conversation(fmt):
    call = {"type": "function", "function": {"name": "sub", "arguments": {"old": "*", "new": "+"}}}
    return [
        {"role": "system", "content": "Fix the code."},
        {"role": "user", "content": "task : fix\nL0 def f ( a ) :"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "sub", "content": "ok L5 x = a + 4"},
    ]


@pytest.mark.parametrize("fmt", list(FAMILIES))
def test_render_matches_transformers_apply_chat_template(tokenizers, fmt):
    path, tok = tokenizers[fmt]
    hf = AutoTokenizer.from_pretrained(path)
    tools = [s.as_json() for s in TOOL_SPECS]
    for gen in (False, True):
        want = hf.apply_chat_template(
            conversation(fmt), tools=tools, add_generation_prompt=gen, tokenize=False
        )
        assert tok.render(conversation(fmt), tools, add_generation_prompt=gen) == want
    ids = hf.apply_chat_template(conversation(fmt), tools=tools, tokenize=True, return_dict=True)
    assert tok.encode(tok.render(conversation(fmt), tools)) == list(ids["input_ids"])


def test_protocol_ids_name_the_family_tokens(tokenizers):
    qwen, harmony = tokenizers["qwen"][1], tokenizers["harmony"][1]
    assert qwen.token(qwen.eot_id) == "<|im_end|>"
    assert (qwen.token(qwen.call_start_id), qwen.token(qwen.call_end_id)) == (
        "<tool_call>",
        "</tool_call>",
    )
    assert harmony.token(harmony.call_end_id) == "<|call|>"
    assert harmony.token(harmony.eot_id) == "<|return|>"
    chatml = tokenizers["chatml"][1]  # no tool-call tokens: a call ends its ChatML turn
    assert chatml.fmt.name == "chatml" and chatml.tokenizer.token_to_id("<tool_call>") is None
    assert chatml.token(chatml.call_end_id) == chatml.token(chatml.eot_id) == "<|im_end|>"
    for tok in (qwen, harmony, chatml):
        assert tok.decode([tok.nl_id]) == "\n" and tok.vocab_size == 600


@pytest.mark.parametrize(
    "text,error",
    [
        ('<tool_call>\n{"name": "run", "arguments": {}}\n</tool_call>', None),
        ('<tool_call>{"name": "run", "arguments": "{\\"a\\": 1}"}</tool_call>', None),
        ("I will run the tests.", "no tool call"),
        ('<tool_call>{"name": "run", "arguments": {}', "unterminated tool call"),
        ("<tool_call>{name: run}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
        ('<tool_call>{"name": "run", "arguments": [1]}</tool_call>', "not a JSON object"),
        ('<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>', "one tool"),
    ],
)
def test_qwen_tool_call_parsing(text, error):
    got = QwenToolCalls().parse(text)
    if error is None:
        assert got.error is None and got.name == "run"
    else:
        assert got.name is None and error in got.error


def test_harmony_tool_call_parsing():
    fmt = HarmonyToolCalls()
    text = "<|channel|>analysis<|message|>look first<|end|><|start|>assistant" + fmt.render_call(
        "view", {"target": "L1 L3"}
    )
    assert fmt.parse(text) == ParsedCall("view", {"target": "L1 L3"})
    assert "no tool call" in fmt.parse("<|channel|>final<|message|>done<|return|>").error
    assert "recipient" in fmt.parse("<|channel|>commentary<|message|>{}<|call|>").error
    assert "JSON object" in fmt.parse("<|channel|>c to=functions.run<|message|>[<|call|>").error


@pytest.mark.parametrize(
    "call,error",
    [
        (ParsedCall("fix", {}), "unknown tool fix; tools: run, view, edit, sub, submit"),
        (ParsedCall("sub", {"old": "*"}), "sub needs argument new"),
        (ParsedCall("sub", {"old": "*", "new": 3}), "sub argument new must be a string"),
        (ParsedCall("run", {"fast": "yes"}), "run has no argument fast; arguments: none"),
        (ParsedCall("sub", {"old": "*", "new": "+"}), None),
    ],
)
def test_calls_are_checked_against_the_tool_schemas(call, error):
    assert check_call(call, TOOL_SPECS) == error


@pytest.mark.parametrize("task", TASKS[:3], ids=lambda t: f"seed{t.seed}")
def test_text_env_plays_the_same_episode_as_the_token_env(task):
    """Expert word calls <-> structured calls round trip, and ``step_call`` answers what
    ``step`` answers (text and step result)."""
    words_env, text_env = CodeRepairEnv(), CodeRepairEnv()
    words_env.reset(task)
    text_env.reset_text(task)
    expert = ExpertPolicy(task)
    for words in expert.plan:
        name, args = call_from_words(words)
        assert call_words(name, args) == list(words)
        obs_ids, res_w = words_env.step(expert.action_ids(words))
        obs_text, res_t = text_env.step_call(name, args)
        assert words_env.tokenizer.encode(obs_text) == obs_ids[1 : -1 - res_w.done]
        assert res_t == res_w
    assert res_t.done and res_t.outcome_reward == 1.0


@pytest.mark.parametrize("fmt", list(FAMILIES))
def test_chat_expert_solves_a_task_token_in_token_out(tokenizers, fmt):
    """The expert's calls in the family's format solve the task through ChatEnv, and the ids
    (prompt, then each action and observation, tokenised on their own) equal the tokenisation
    of the template's rendering of the whole conversation."""
    _, tok = tokenizers[fmt]
    task = TASKS[0]
    env = ChatEnv(CodeRepairEnv(), tok)
    policy = ChatExpertPolicy(ExpertPolicy(task), tok)
    stream = env.reset(task)
    for _ in range(len(policy.calls)):
        action = policy(stream)
        obs, res = env.step(action)
        assert env.last_call.error is None
        stream += action + obs
        if res.done:
            break
    assert res.done and res.outcome_reward == 1.0
    calls = [m["tool_calls"][0]["function"] for m in env.messages if m.get("tool_calls")]
    assert [(c["name"], c["arguments"]) for c in calls] == policy.calls
    assert stream == tok.encode(tok.render(env.messages, env.tools))


def _merged_token(tok):
    """A vocabulary entry of >= 4 characters that encodes alone (a learned merge)."""
    for i in range(tok.vocab_size):
        text = tok.decode([i])
        if len(text) >= 4 and text.isalpha() and tok.encode(text) == [i]:
            return text
    raise AssertionError("no merged token")


def test_retokenising_is_not_token_in_token_out(tokenizers):
    """The failure class: a merge across a text boundary and decode -> encode not being a
    bijection. ChatEnv keeps the sampler's ids: a valid call spelled in non-canonical ids is
    parsed, and the observation ids are encoded on their own."""
    _, tok = tokenizers["qwen"]
    word = _merged_token(tok)
    a, b = word[:2], word[2:]
    split = tok.encode(a) + tok.encode(b)
    assert split != tok.encode(a + b)  # merge across the boundary
    assert tok.encode(tok.decode(split)) != split  # decode -> encode is not a bijection
    env = ChatEnv(CodeRepairEnv(), tok)
    prompt = env.reset(TASKS[0])
    text = QwenToolCalls().render_call("run", {})
    action = [i for ch in text.split("<|im_end|>")[0] for i in tok.encode(ch)] + [tok.eot_id]
    assert action != tok.encode(text)  # non-canonical spelling of the same call
    obs, res = env.step(action)
    assert env.last_call == ParsedCall("run", {}) and not res.log["error"]
    assert obs == tok.encode(tok.decode(obs))  # the observation alone is canonical
    stream = prompt + action + obs
    assert tok.encode(tok.decode(stream)) != stream  # re-tokenising would change the ids


def test_turn_separators_are_neither_dropped_nor_duplicated(tokenizers):
    """A turn that stopped at </tool_call> is closed by the observation; one that ended with
    <|im_end|> is not closed twice; each observation ends with one generation prompt."""
    _, tok = tokenizers["qwen"]
    env = ChatEnv(CodeRepairEnv(), tok)
    env.reset(TASKS[1])
    im_end, im_start = tok.encode("<|im_end|>"), tok.encode("<|im_start|>")
    gen = tok.encode("<|im_start|>assistant\n")
    closed = tok.encode(QwenToolCalls().render_call("run", {}))
    obs, _ = env.step(closed)
    assert obs[0] == tok.nl_id and obs[1] == im_start[0]
    assert obs[-len(gen) :] == gen and obs.count(im_start[0]) == 2
    open_turn = closed[: -len(im_end)]  # stopped at </tool_call>
    obs, _ = env.step(open_turn)
    assert obs[:2] == [im_end[0], tok.nl_id] and obs[-len(gen) :] == gen
    truncated = tok.encode('<tool_call>\n{"name": "vi')  # the token budget ran out
    obs, res = env.step(truncated)
    assert obs[:2] == [im_end[0], tok.nl_id] and res.log["error"]


@pytest.mark.parametrize(
    "text,error",
    [
        ("let me think", "no tool call"),
        ('<tool_call>{"name": "fix", "arguments": {}}</tool_call>', "unknown tool fix"),
        (
            '<tool_call>{"name": "sub", "arguments": {"old": 1}}</tool_call>',
            "sub needs argument new",
        ),
    ],
)
def test_bad_calls_become_error_observations(tokenizers, text, error):
    _, tok = tokenizers["qwen"]
    env = ChatEnv(CodeRepairEnv(), tok)
    env.reset(TASKS[2])
    obs, res = env.step(tok.encode(text + "<|im_end|>"))
    assert res.log["error"] and not res.done and res.process["rejected"] == -1.0
    assert res.log["text"] == tok.decode(tok.encode(text + "<|im_end|>"))  # the call as written
    assert f"error {error}" in tok.decode(obs)
    assert env.messages[-1]["role"] == "user"  # answered as a user turn, the episode goes on
    obs, res = env.step(tok.encode(QwenToolCalls().render_call("run", {})))
    assert not res.log["error"] and "pass" in tok.decode(obs)
    assert np.all(np.asarray(obs) < tok.vocab_size)


def test_agent_loop_plays_chat_env_unchanged(tokenizers):
    """A tiny Qwen3 (vocabulary of the BPE) plays code repair through ChatEnv in the existing
    agent loop; every observation in the trajectory is what ChatEnv answers to the sampled turn
    before it, tokenised on its own (replayed here turn by turn), after the prompt ids; each
    turn's log holds the turn's text as decoded."""
    import jax

    from agentrl_jax.hf import load_pretrained
    from agentrl_jax.hf.tiny import make_tiny_hf
    from agentrl_jax.model.transformer import Transformer
    from agentrl_jax.precision import get_policy
    from agentrl_jax.rollout.agent_loop import run_episodes
    from agentrl_jax.rollout.sampler import RolloutConfig

    path, tok = tokenizers["qwen"]
    make_tiny_hf("qwen3", path, vocab_size=tok.vocab_size, num_hidden_layers=2)
    cfg, params = load_pretrained(path)
    traj = run_episodes(
        Transformer(cfg, get_policy("fp32")), params, TASKS[:2],
        lambda: ChatEnv(CodeRepairEnv(), tok), tok,
        RolloutConfig(max_new_tokens=12, max_len=1024, page_size=16), jax.random.key(0),
        max_turns=2,
    )  # fmt: skip
    texts = []
    for row, task in enumerate(TASKS[:2]):
        tokens = np.asarray(traj.tokens[row])
        mask, turns = np.asarray(traj.action_mask[row]), np.asarray(traj.turn_ids[row])
        env = ChatEnv(CodeRepairEnv(), tok)
        prompt = env.reset(task)
        assert tokens[: len(prompt)].tolist() == prompt and not mask[: len(prompt)].any()
        for k in (1, 2):
            action = tokens[(turns == k) & mask].tolist()
            observed = tokens[(turns == k) & ~mask].tolist()
            assert action, "the model sampled a turn"
            texts.append(tok.decode(action))
            obs, _ = env.step(action)
            assert observed == obs[: len(observed)] and (k == 2 or observed == obs)
    assert sorted(r["text"] for r in traj.logs) == sorted(texts)


def test_template_that_rewrites_earlier_turns(tokenizers):
    """Qwen3's template renders a thinking block in the last assistant turn only: a turn's
    text changes once a reply follows it. ChatEnv still cuts each observation after the turn's
    end marker (never re-rendering what the model produced)."""
    from agentrl_jax.hf.tiny import CHATML_TEMPLATE
    from agentrl_jax.hf.tokenizer import HFTokenizer

    _, tok = tokenizers["qwen"]
    old = "{{- '<|im_start|>assistant\\n' + (message.content or '') }}"
    new = (
        "{{- '<|im_start|>assistant\\n' }}{%- if loop.last %}{{- '<think>\\n\\n</think>\\n\\n' }}"
        "{%- endif %}{{- message.content or '' }}"
    )
    assert old in CHATML_TEMPLATE
    thinking = HFTokenizer(tok.tokenizer, CHATML_TEMPLATE.replace(old, new), QwenToolCalls())
    env = ChatEnv(CodeRepairEnv(), thinking)
    env.reset(TASKS[0])
    for name, args in ChatExpertPolicy(ExpertPolicy(TASKS[0]), thinking).calls[:3]:
        obs, res = env.step(thinking.encode(QwenToolCalls().render_call(name, args)))
        text = thinking.decode(obs)
        assert text.startswith("\n<|im_start|>user\n<tool_response>\n") and not res.log["error"]
        assert text.endswith("<|im_start|>assistant\n") and "<think>" not in text
