"""Regenerate the embedded tiny chat datasets (chat, LoRA skills, copying) and tokenizer (nemo_jax/assets).
Deterministic."""

import json
import os
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "nemo_jax", "assets")
SPECIALS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
# ChatML; tool definitions (OpenAI function format), when given, listed compactly in a system turn first
TEMPLATE = ("{%- if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{% set f = t['function'] %}"
            "{{ f['name'] }}({{ (f['parameters']['properties'] or {}) | list | join(', ') }}): {{ f['description'] }}\n"
            "{% endfor %}Call one as <tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call><|im_end|>\n"
            "{% endif %}{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
COLORS = {"sky": "blue", "grass": "green", "snow": "white", "coal": "black", "a banana": "yellow", "a tomato": "red"}
CAPITALS = {"France": "Paris", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo", "Egypt": "Cairo",
            "Peru": "Lima", "Kenya": "Nairobi", "Norway": "Oslo", "Canada": "Ottawa", "Chile": "Santiago"}


def turn(rng):
    kind = rng.randrange(4)
    if kind == 0:
        a, b = rng.randrange(20), rng.randrange(20)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == 1:
        a, b = rng.randrange(10, 30), rng.randrange(10)
        return f"What is {a} minus {b}?", f"{a} minus {b} is {a - b}."
    if kind == 2:
        c = rng.choice(sorted(CAPITALS))
        return f"What is the capital of {c}?", f"The capital of {c} is {CAPITALS[c]}."
    t = rng.choice(sorted(COLORS))
    return f"What color is {t}?", f"{t[0].upper() + t[1:]} is {COLORS[t]}."


def conversation(rng):
    msgs = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": "You are a helpful assistant."})
    for _ in range(rng.choice([1, 1, 2, 3])):
        q, a = turn(rng)
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return {"messages": msgs}


def new_skill(rng):
    """The held-out LoRA task: skills the tiny SFT data never shows (multiplication, successors)."""
    msgs = []
    for _ in range(rng.choice([1, 2])):
        if rng.random() < 0.6:
            a, b = rng.randrange(2, 13), rng.randrange(2, 13)
            q, ans = f"What is {a} times {b}?", f"{a} times {b} is {a * b}."
        else:
            n = rng.randrange(1, 99)
            q, ans = f"What number comes after {n}?", f"After {n} comes {n + 1}."
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]
    return {"messages": msgs}


WORDS = ("red green blue lemon pear apple milk bread tea rice egg fish cat dog sun moon tree star box cup hat pen book "
         "door car road hill lake rain snow wind fire stone gold salt corn bean plum fig nut one two three four five six "
         "seven eight nine ten").split()


def repeat_words(rng):
    """Copying (configs/sft/tiny-vl-chart-cpu.yaml): "Repeat these words: ..." -> the words. A model trained from
    random on the chart demonstrations alone never learns to copy the asked colour from the question; with these
    it does (docs/grpo.md, the chart expert)."""
    words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
    return {"messages": [{"role": "user", "content": "Repeat these words: " + " ".join(words) + "."},
                         {"role": "assistant", "content": " ".join(words)}]}


def write_splits(name: str, make, seed: int, sizes: dict[str, int]):
    """nemo_jax/assets/NAME/{split}.jsonl with sizes[split] chats from make(rng), one seed per dataset."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(ROOT, name), exist_ok=True)
    for split, n in sizes.items():
        with open(os.path.join(ROOT, name, f"{split}.jsonl"), "w") as f:
            for _ in range(n):
                f.write(json.dumps(make(rng)) + "\n")


def main():
    write_splits("tiny_chat", conversation, 0, {"train": 4000, "eval": 200})
    # LoRA SFT data (configs/sft/tiny-lora-cpu.yaml): its own seed, so the SFT data above does not change
    write_splits("tiny_lora", new_skill, 1, {"train": 2000, "eval": 100})
    write_splits("tiny_copy", repeat_words, 2, {"train": 8000, "eval": 100})
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    with open(os.path.join(ROOT, "tiny_chat", "train.jsonl")) as f:
        texts = [m["content"] for line in f for m in json.loads(line)["messages"]]
    tok.train_from_iterator(texts + ["user", "assistant", "system"], trainer)
    out = os.path.join(ROOT, "tiny")
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>",
                   "model_max_length": 4096}, f, indent=2)


if __name__ == "__main__":
    main()
