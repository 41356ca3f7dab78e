"""A tiny, deterministic byte-level BPE tokenizer for tests that build their own checkpoints.

No hub downloads are possible here, so tests train this one from a small built-in corpus.
Special tokens keep Qwen's names (ChatML, `<think>`, `<tool_call>`) but sit at fixed low ids
0..6 so that any `vocab_size >= 263` (7 specials + 256 bytes) fits every id below `vocab_size`.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Order defines the ids: the BPE trainer assigns special tokens first, in list order.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",  # 0, pad
    "<|im_start|>",  # 1
    "<|im_end|>",  # 2, eos
    "<think>",  # 3
    "</think>",  # 4
    "<tool_call>",  # 5
    "</tool_call>",  # 6
)
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
N_BYTES = 256
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + N_BYTES

# Splits text like GPT/Qwen pre-tokenizers do, and keeps each digit its own piece so that
# arithmetic prompts tokenize digit by digit (as Qwen does).
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+"
    r"|\s+(?!\S)"
    r"|\s+"
)

# Qwen-style ChatML. Tool results are wrapped in a user turn (as Qwen does), assistant
# reasoning goes inside <think>...</think>, and `enable_thinking=false` pre-fills an empty
# think block at the generation prompt.
CHAT_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions. Function signatures:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nReturn each call as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\\n' }}
{%- elif messages and messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}
{%- if not loop.first %}{{- raise_exception('A system message is only allowed first.') }}{%- endif %}
{%- elif message['role'] == 'user' %}
{{- '<|im_start|>user\\n' + message['content'] + '<|im_end|>\\n' }}
{%- elif message['role'] == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.get('reasoning_content') %}
{{- '<think>\\n' + message['reasoning_content'] + '\\n</think>\\n\\n' }}
{%- endif %}
{{- message.get('content') or '' }}
{%- for call in message.get('tool_calls') or [] %}
{%- set fn = call['function'] if call.get('function') else call %}
{%- if loop.first and message.get('content') %}{{- '\\n' }}{%- endif %}
{%- if not loop.first %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{"name": "' + fn['name'] + '", "arguments": ' }}
{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message['role'] == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- else %}
{{- raise_exception('Unknown role: ' + message['role']) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

_ENGLISH = """\
The quick brown fox jumps over the lazy dog. A small model learns to answer simple questions.
Reinforcement learning improves the policy by rewarding correct answers and penalizing wrong ones.
The teacher explains the problem step by step, and the student writes the final answer.
Today the weather is sunny and warm, so we will walk to the park and read a book.
Language models predict the next token given all previous tokens in the sequence.
Please think carefully before you answer. Show your reasoning, then give the result.
The engine generates responses, the trainer updates the weights, and the loop repeats.
Each prompt has a group of samples; the reward of each sample is compared to the group mean.
I think that the answer is correct, but let me check it again to be sure.
You are a helpful assistant. You answer questions about math, science and everyday life.
She said: "It's easy once you've seen it." They'll try again tomorrow; we're ready now.
Numbers, letters and symbols: (a + b) * c = d, x - y / z, 100% sure, $5.00, #1, @home.
The function returns a list of tokens, and the server sends them back as JSON.
Call the tool with the city name to get the weather, then summarize the result for the user.
"""


def _arithmetic_corpus() -> str:
    """Deterministic "What is a+b?" style prompts with their answers."""
    lines: list[str] = []
    for a in range(0, 20):
        for b in range(0, 20, 3):
            lines.append(f"What is {a}+{b}? The answer is {a + b}.")
            lines.append(f"Compute {a} * {b}. Answer: {a * b}")
            lines.append(f"What is {a + b}-{b}? <think>{a + b} minus {b} is {a}.</think> {a}")
    return "\n".join(lines)


def _corpus() -> list[str]:
    return _ENGLISH.splitlines() + _arithmetic_corpus().splitlines()


def build_tiny_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on the built-in corpus; `len(tok) <= vocab_size`, ids 0..6 special."""
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be >= {MIN_VOCAB_SIZE} (7 special tokens + 256 byte tokens); "
            f"got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes up front: that is what makes any text encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:  # guards against a tokenizers release changing the order
            raise RuntimeError(f"special token {s!r} got id {tok.token_to_id(s)}, expected {i}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[SPECIAL_TOKENS[1], *SPECIAL_TOKENS[3:]],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # would break byte-exact round trips
    )


def save_tiny_tokenizer(path: Path, vocab_size: int = 512) -> None:
    """Write the tiny tokenizer in Hugging Face format (tokenizer.json, tokenizer_config.json).

    transformers 5 writes no special_tokens_map.json: the special tokens live in tokenizer_config.json.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # The chat template goes inside tokenizer_config.json (not chat_template.jinja) so that
    # readers that only look there, such as older loaders and routers, find it.
    build_tiny_tokenizer(vocab_size).save_pretrained(str(path), save_jinja_files=False)
