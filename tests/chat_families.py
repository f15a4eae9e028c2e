"""Chat templates of the common families, written for these tests in three variants, and records that exercise them.

Each family renders an assistant turn as ``lead + content + end_of_turn + after`` following the generation prompt
(the header). The variants differ only in ``{% generation %}`` markers: ``plain`` has none, ``eot`` encloses the
lead, content and end of turn (what TRL's training templates mark: text after the end of turn is not trained),
``turn`` encloses the whole turn, ``after`` included (what our rule without markers trains). The shipped
tokenizer has no chat special tokens, so markers such as ``<|im_end|>`` are plain text here: tokenisation across
the boundaries is what these cases are about.
"""

from __future__ import annotations

import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "data", "tokenizer")

# family -> Jinja expressions: bos (once, first), system (None: the system text joins the first user turn), user,
# assistant header (= the generation prompt), and the turn's lead, end of turn and what follows it
FAMILIES = {
    # LLaMA-2 chat (the shipped template): BOS before every user turn; the answer after "[/INST]" begins with a
    # space of its own; no generation prompt
    "llama2": dict(bos="''", system=None, user="bos_token ~ '[INST] ' ~ text ~ ' [/INST]'", header="''",
                   lead="' '", end="' ' ~ eos_token", after="''"),
    "llama3": dict(bos="bos_token", system="'<|start_header_id|>system<|end_header_id|>\\n\\n' ~ text ~ '<|eot_id|>'",
                   user="'<|start_header_id|>user<|end_header_id|>\\n\\n' ~ text ~ '<|eot_id|>'",
                   header="'<|start_header_id|>assistant<|end_header_id|>\\n\\n'", lead="''", end="'<|eot_id|>'",
                   after="''"),
    # ChatML (Qwen): "\n" after the end of turn, inside the turn
    "chatml": dict(bos="''", system="'<|im_start|>system\\n' ~ text ~ '<|im_end|>\\n'",
                   user="'<|im_start|>user\\n' ~ text ~ '<|im_end|>\\n'", header="'<|im_start|>assistant\\n'",
                   lead="''", end="'<|im_end|>'", after="'\\n'"),
    # Mistral v0.1: the answer is glued to "[/INST]"
    "mistral": dict(bos="bos_token", system=None, user="'[INST] ' ~ text ~ ' [/INST]'", header="''", lead="''",
                    end="eos_token", after="''"),
    # a generation prompt ending in a space (merged into the answer's first token) and text after the end of turn
    "bot": dict(bos="bos_token", system="'System: ' ~ text ~ '\\n'", user="'User: ' ~ text ~ '\\n'",
                header="'[BOT] '", lead="''", end="eos_token", after="'\\n'"),
}
VARIANTS = ("plain", "eot", "turn")


def template(family: str, variant: str) -> str:
    f = FAMILIES[family]
    body = f"{f['lead']} ~ message['content'] ~ {f['end']}"
    if variant == "plain":
        answer = f"{{{{- {body} ~ {f['after']} -}}}}"
    elif variant == "eot":
        answer = f"{{%- generation -%}}{{{{- {body} -}}}}{{%- endgeneration -%}}{{{{- {f['after']} -}}}}"
    else:
        answer = f"{{%- generation -%}}{{{{- {body} ~ {f['after']} -}}}}{{%- endgeneration -%}}"
    if f["system"]:
        system = f"{{%- if system is not none -%}}{{%- set text = system -%}}{{{{- {f['system']} -}}}}{{%- endif -%}}"
        first_user = "message['content']"
    else:
        system = ""
        first_user = "system ~ '\\n\\n' ~ message['content'] if system is not none and loop.first else message['content']"
    return (
        f"{{{{- {f['bos']} -}}}}"
        "{%- set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none -%}"
        f"{system}"
        "{%- for message in messages if message['role'] != 'system' -%}"
        "{%- if message['role'] == 'user' -%}"
        f"{{%- set text = {first_user} -%}}{{{{- {f['user']} -}}}}"
        f"{{%- else -%}}{{{{- {f['header']} -}}}}{answer}{{%- endif -%}}"
        "{%- endfor -%}"
        f"{{%- if add_generation_prompt -%}}{{{{- {f['header']} -}}}}{{%- endif -%}}"
    )


def write_templates(directory) -> dict[tuple[str, str], str]:
    """Every (family, variant) written as a Jinja file under ``directory``; their paths."""
    paths = {}
    for family in FAMILIES:
        for variant in VARIANTS:
            path = os.path.join(directory, f"{family}-{variant}.jinja")
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(template(family, variant))
            paths[family, variant] = path
    return paths


def message_records() -> list[dict]:
    """Twelve conversations: shipped ones (system, multi-turn) and answers that start with a multi-byte character,
    a space, a digit, or punctuation that merges with the header's last character."""
    shipped = [json.loads(line) for line in open(os.path.join(ROOT, "data", "chat", "chat_messages.jsonl"),
                                                 encoding="utf-8")]
    picked = [shipped[0], shipped[1], shipped[27]] + [r for r in shipped if len(r["messages"]) == 5][:1]

    def chat(*turns: str, system: str | None = None) -> dict:
        roles = ["user", "assistant"] * len(turns)
        messages = [{"role": role, "content": text} for role, text in zip(roles, turns)]
        return {"messages": ([{"role": "system", "content": system}] if system else []) + messages}

    return picked + [
        chat("Which planet is largest?", "Jupiter is."),
        chat("Greet me.", "\U0001f642 Hello there!"),
        chat("Say it with a space.", " Spaced out."),
        chat("What is 2 + 2?", "4, of course.", "And 3 + 3?", "6."),
        chat("Quote something.", "\"To be, or not to be.\"", system="Quote Shakespeare."),
        chat("Bracket it.", "]) closing first."),
        chat("Accents?", "\u00c9t\u00e9 \u00e0 Paris, caf\u00e9 cr\u00e8me."),
        chat("One word.", "Yes."),
    ]


def prompt_completion_records() -> list[dict]:
    """The same conversations as TRL's conversational prompt/completion: every turn before the last is the prompt."""
    return [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in message_records()]


OTHER_ANSWER = "I would rather not say."


def preference_records() -> list[dict]:
    """Implicit-prompt preference pairs: each of :func:`message_records` as chosen, its last answer swapped for a
    refusal as rejected."""
    records = []
    for r in message_records():
        chosen = r["messages"]
        records.append({"chosen": chosen, "rejected": [*chosen[:-1], {"role": "assistant", "content": OTHER_ANSWER}]})
    return records
