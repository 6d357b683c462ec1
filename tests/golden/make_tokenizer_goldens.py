#!/usr/bin/env python3
"""Makes nextlm's tokenizer goldens with Hugging Face `tokenizers` and transformers (run where both are installed).

GLM's own tokenizer.json cannot be downloaded where this runs, so the script TRAINS small byte-level BPE tokenizers
in GLM's style on a corpus it builds itself: a Split pre-tokenizer with GLM's regex (behavior "isolated"), then
ByteLevel(add_prefix_space=False, use_regex=False), the ByteLevel decoder and post-processor, and GLM's special
tokens appended after the trained vocabulary (as GLM's ids 151329.. follow its BPE vocabulary). A second variant
uses the GPT-4o-style regex, special tokens inside the trained vocabulary, and added tokens with lstrip / rstrip /
single_word / non-special flags. The third, "hand", is the hand-written tests/golden/tokenizer/hand/tokenizer.json
read as it is. For each variant it records, on a test corpus different from the training text:
the pre-tokenized pieces, the ids of `Tokenizer.encode`, and `Tokenizer.decode` of those ids and of random id lists
(with and without skip_special_tokens). It also renders a GLM-4.5-style chat template (text messages) through
transformers' `apply_chat_template` and records the text and its ids.

Usage: python3 tests/golden/make_tokenizer_goldens.py OUT_DIR
Writes OUT_DIR/<variant>/{tokenizer.json, tokenizer_config.json, cases.json, chat.json}, OUT_DIR/regex.json (Split
pre-tokenizers with other patterns and behaviours on short texts) and OUT_DIR/VERSIONS.
Everything is deterministic (fixed seeds); the output is about 770 KB.
"""
import json
import os
import random
import shutil
import sys

import tokenizers
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# GLM-4 / GLM-4.5's pre-tokenizer regex (the Llama-3 one).
GLM_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
             r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# GPT-4o / o200k style (case classes, contractions as suffixes, a trailing slash class).
O200K_REGEX = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n/]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+"])

GLM_SPECIAL = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
               "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<think>", "</think>"]

# A GLM-4.5-style chat template for text messages: the system / user / assistant / tool (string content) branches
# and the generation prompt of GLM-4.5's template, without tools and images. nextlm's src/io/chat_template.cpp
# renders exactly this.
CHAT_TEMPLATE = """[gMASK]<sop>
{%- set ns = namespace(last_user_index=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {%- set ns.last_user_index = loop.index0 -%}
    {%- endif %}
{%- endfor %}
{%- for m in messages -%}
{%- if m.role == 'user' -%}<|user|>
{{ m.content }}
{{- '/nothink' if (enable_thinking is defined and not enable_thinking and not m.content.endswith("/nothink")) else '' -}}
{%- elif m.role == 'assistant' -%}
<|assistant|>
{%- set reasoning_content = '' %}
{%- set content = m.content %}
{%- if '</think>' in content %}
    {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
    {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_user_index and reasoning_content -%}
{{ '\\n<think>' + reasoning_content.strip() +  '</think>'}}
{%- else -%}
{{ '\\n<think></think>' }}
{%- endif -%}
{%- if content.strip() -%}
{{ '\\n' + content.strip() }}
{%- endif -%}
{%- elif m.role == 'tool' -%}
{%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
    {{- '<|observation|>' }}
{%- endif %}
{{- '\\n<tool_response>\\n' }}
{{- m.content }}
{{- '\\n</tool_response>' }}
{%- elif m.role == 'system' -%}
<|system|>
{{ m.content }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    <|assistant|>{{- '\\n<think></think>' if (enable_thinking is defined and not enable_thinking) else '' -}}
{%- endif -%}"""

WORDS = ("the of and to in is was for that with as on by at from his her an which or be this are not had have it "
         "were but they their one all there been has who when more would will she also into its time may about "
         "only other new some could these two first then them can over such like than most after our what made "
         "between many before through where back any much under being years those each state well people during "
         "because world without great same another three while since own part against small large high old "
         "Government University John London America English October River city music history village water "
         "running quickly Tokenizer tokenization pre-tokenizer byte-level merges vocabulary").split()
CJK = ["我们", "的", "模型", "语言", "你好", "世界", "中文", "测试", "分词器", "数据", "训练", "推理", "日本語", "こんにちは",
       "ありがとう", "カタカナ", "ひらがな", "東京", "한국어", "안녕하세요", "감사합니다", "서울"]
OTHER = ["café", "naïve", "façade", "Ærøskøbing", "Straße", "Zürich", "señor", "Ελληνικά", "Привет", "мир", "Москва",
         "Українська", "مرحبا", "العربية", "שלום", "हिन्दी", "ไทย", "Tiếng Việt", "Ģirts", "ǅemal", "ﬁnance"]
EMOJI = ["😀", "🚀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🇫🇷", "1️⃣", "🧑🏿‍💻", "✨"]
CODE = [
    "def f(x):\n    return x * 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "if __name__ == \"__main__\":\n    main()\n",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }\n",
    "SELECT id, name FROM users WHERE age >= 18;\n",
    "    x = [1, 2, 3]\n        y = {'a': 1}\n",
    "fn main() -> Result<(), Box<dyn Error>> { Ok(()) }\r\n",
    "<div class=\"a\">&nbsp;</div>\n",
    "const re = /\\s+(?!\\S)/g; // regex\n",
]


def sentence(rng, n):
    ws = [rng.choice(WORDS) for _ in range(n)]
    ws[0] = ws[0].capitalize()
    return " ".join(ws) + rng.choice([".", "!", "?", ",", ";", ":", "..."])


def contraction(rng):
    base = rng.choice(["it", "he", "she", "we", "they", "you", "I", "John", "that", "there"])
    suf = rng.choice(["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'Ve", "'LL", "'D", "'M"])
    return base + suf


def number(rng):
    k = rng.choice([1, 2, 3, 4, 5, 6, 7, 9, 12, 17])
    s = "".join(rng.choice("0123456789") for _ in range(k))
    return rng.choice([s, s + "." + str(rng.randint(0, 999)), "-" + s, s + "%", "$" + s, s + "th"])


def spaces(rng):
    return rng.choice([" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r\n\r\n", " \n", "\n ", "\t\t", " \t ",
                       "\n\n\n", "    ", "\u3000", "\u00a0", "\r", " \r\n "])


def mixed(rng, specials, n):
    parts = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.35:
            parts.append(sentence(rng, rng.randint(2, 9)))
        elif kind < 0.45:
            parts.append(contraction(rng))
        elif kind < 0.55:
            parts.append(number(rng))
        elif kind < 0.65:
            parts.append("".join(rng.choice(CJK) for _ in range(rng.randint(1, 4))))
        elif kind < 0.73:
            parts.append(rng.choice(OTHER))
        elif kind < 0.79:
            parts.append(rng.choice(EMOJI))
        elif kind < 0.87:
            parts.append(rng.choice(CODE))
        elif kind < 0.93 and specials:
            parts.append(rng.choice(specials))
        else:
            parts.append(rng.choice(["(", ")", "...", "--", "—", "«", "»", "\"", "'", "`", "#", "@", "!!", "?!",
                                     "/", "\\", "*", "->", "=>", "::", ";;", "<", ">", "|", "[", "]"]))
        parts.append(spaces(rng) if rng.random() < 0.5 else " ")
    return "".join(parts)


def training_corpus(seed):
    rng = random.Random(seed)
    lines = [mixed(rng, [], rng.randint(5, 30)) for _ in range(3000)]
    lines += CODE * 20 + [" ".join(CJK)] * 20 + [" ".join(OTHER)] * 20 + [" ".join(EMOJI)] * 10
    return lines


# Hand-picked edge cases, then random mixtures (with a different seed from training).
EDGE_CASES = [
    "", " ", "  ", "\n", "\r\n", "\t", "a", "A", "Hello, world!", "Hello world", " Hello world", "Hello  world",
    "Hello   world  ", "hello\nworld", "hello\n\nworld", "hello \n world", "a\r\nb\r\n\r\nc", "\n\n\n\nx",
    "x\n\n\n\n", "   \n   ", "\t\tindented\n\t\t\tmore", "trailing spaces   ", "   leading spaces",
    "I'm you're we've they'll she'd it's don't", "I'M YOU'RE WE'VE THEY'LL SHE'D IT'S DON'T",
    "It'S wE'Ve tHey'Ll", "'s 's's ''s 'x 'S", "rock'n'roll o'clock", "the dog's bone's", "it\u2019s curly",
    "'ſ 'ſt \u212a", "1", "12", "123", "1234", "12345", "123456", "1234567", "3.14159", "1,000,000", "-42", "0x1F",
    "١٢٣٤٥", "٣.١٤", "²³¹", "ⅫⅣ", "①②③", "１２３４", "a1b2c3", "abc123def", "v1.2.3-rc4",
    "你好世界", "你好，世界！", "我们在2024年训练了模型。", "日本語のテキストです。", "カタカナとひらがな", "한국어 텍스트입니다.",
    "café naïve façade", "e\u0301 a\u0300 n\u0303", "Straße ǅemal ﬁnance", "Привет, мир!", "Ελληνικά κείμενα",
    "مرحبا بالعالم", "שלום עולם", "हिन्दी पाठ", "ไทยภาษา", "Tiếng Việt có dấu",
    "😀🚀✨", "👍🏽 👨‍👩‍👧‍👦 🏳️‍🌈", "🇫🇷🇩🇪🇯🇵", "1️⃣2️⃣", "a😀b", "😀 😀  😀",
    "<|endoftext|>", "[gMASK]<sop><|user|>\nhi<|assistant|>", "x<|user|>y", "<|user|><|user|>", "<|user|",
    "<|user |>", "[gMASK", "[MASK] [sMASK] [gMASK]", " <sop> <eop> ", "<think>reason</think>answer",
    "text<|observation|>\n", "<|system|>\nYou are a helpful assistant.<|user|>\nWhat's 2+2?<|assistant|>",
    "\u0000\u0001\u001f\u007f", "\ufeffBOM", "\ufffd\ufffd", "\ue000\uf8ff", "\U0001F600\U0010FFFD",
    "\u200b\u200c\u200d", "\u2028\u2029", "\u0085", "\u000b\u000c", "a\u00a0b", "\u3000\u3000x",
    "…—–", "«quoted»", "((()))", "!!!???", "a.b.c", "...", "--help", "/usr/bin/env", "C:\\Windows\\System32",
    "https://example.com/path?q=1&r=2#frag", "user@example.com", "#hashtag @mention", "$100.00 €50 ¥1000",
    "x = y + z * (a - b) / c;", "if (a && b || !c) { return; }", "    def f():\n        pass\n",
    "\tint x;\n\tint y;\n", "line1\r\nline2\r\n", "a  \n  b", "  \n\n  ", " \r\n \r\n ",
]


# Code-point ranges for random strings that stress the regex's Unicode classes: whitespace of every kind, letters
# and numbers of several categories (Lu Ll Lt Lm Lo, Nd Nl No), marks, format and private-use characters,
# supplementary planes and unassigned code points, and the characters of the contractions (including U+017F, which
# case-folds to "s").
RANDOM_RANGES = [(0x20, 0x7E), (0x09, 0x0D), (0xA0, 0xFF), (0x2000, 0x200F), (0x2028, 0x202F), (0x3000, 0x3000),
                 (0x85, 0x85), (0x1680, 0x1680), (0x300, 0x36F), (0x660, 0x669), (0x2160, 0x2188), (0xB2, 0xB3),
                 (0x1C5, 0x1C5), (0x2B0, 0x2C1), (0x4E00, 0x4E2F), (0xAC00, 0xAC2F), (0xFEFF, 0xFEFF),
                 (0xE000, 0xE005), (0x1F300, 0x1F64F), (0x10400, 0x1044F), (0x1D400, 0x1D44F), (0x378, 0x37F),
                 (0x2FFF0, 0x2FFFF), (0x17F, 0x17F), (0x27, 0x27), (0x73, 0x74), (0x53, 0x54)]


def random_texts(n):
    rng = random.Random(99)
    out = []
    for _ in range(n):
        cps = []
        for _ in range(rng.randint(1, 16)):
            lo, hi = rng.choice(RANDOM_RANGES)
            cps.append(chr(rng.randint(lo, hi)))
        out.append("".join(cps))
    return out


def test_corpus(specials, mixtures=120):
    rng = random.Random(20260101)
    texts = list(EDGE_CASES)
    for _ in range(mixtures):
        texts.append(mixed(rng, specials, rng.randint(1, 18)))
    return texts + random_texts(80)


CHATS = [
    ([{"role": "user", "content": "Hello!"}], True, None),
    ([{"role": "user", "content": "Hello!"}], False, None),
    ([{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What's 2+2?"}],
     True, None),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Tell me a joke."}],
     True, None),
    ([{"role": "user", "content": "你好，请介绍一下你自己。"}], True, None),
    ([{"role": "user", "content": "Think first."},
      {"role": "assistant", "content": "<think>\nThe user wants me to think.\n</think>\n\nDone thinking.  "}],
     False, None),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>old</think>b"},
      {"role": "user", "content": "c"}], True, None),
    ([{"role": "user", "content": "no thinking please"}], True, False),
    ([{"role": "user", "content": "already /nothink"}], True, False),
    ([{"role": "user", "content": "thinking on"}], True, True),
    ([{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Let me check."},
      {"role": "tool", "content": "{\"temp\": 21}"}, {"role": "tool", "content": "sunny"}], True, None),
    ([{"role": "user", "content": "  spaced  \n"}, {"role": "assistant", "content": "  \n  "}], True, None),
    ([{"role": "system", "content": ""}, {"role": "user", "content": ""}], True, None),
    ([{"role": "user", "content": "code:\n\tdef f():\n\t\treturn 1\r\n"}], True, None),
    ([{"role": "user", "content": "emoji 👨‍👩‍👧‍👦 and <|user|> inside"}], True, None),
]


def train(regex, vocab_size, trainer_specials, seed):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, show_progress=False,
                                  special_tokens=trainer_specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_corpus(seed), trainer)
    return tok


def variants():
    # glm: GLM's regex; every special token added after training, so their ids follow the BPE vocabulary.
    glm = train(GLM_REGEX, 1200, [], 1)
    glm.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in GLM_SPECIAL])
    # o200k: another regex and vocab size; specials inside the trained vocabulary; added tokens with flags.
    o200k = train(O200K_REGEX, 2000, ["<|endoftext|>", "<|user|>", "<|assistant|>"], 2)
    o200k.add_special_tokens([AddedToken("[gMASK]", special=True, normalized=False),
                              AddedToken("<sop>", special=True, normalized=False),
                              AddedToken("<|system|>", special=True, normalized=False),
                              AddedToken("<|lstrip|>", special=True, normalized=False, lstrip=True),
                              AddedToken("<|rstrip|>", special=True, normalized=False, rstrip=True)])
    o200k.add_tokens([AddedToken("<tool_call>", special=False, normalized=False),
                      AddedToken("word", special=False, normalized=False, single_word=True),
                      AddedToken(" plus ", special=False, normalized=False),
                      AddedToken("the", special=False, normalized=False)])  # also in the BPE vocab: keeps its id
    # hand: the small hand-written file committed beside the goldens (legacy "a b" merges), read as it is.
    hand = Tokenizer.from_file(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer", "hand",
                                            "tokenizer.json"))
    return {"hand": (hand, ["<|user|>", "[gMASK]", "<sop>"]), "glm": (glm, GLM_SPECIAL), "o200k": (o200k, ["<|endoftext|>", "<|user|>", "<|assistant|>", "[gMASK]",
                                                        "<sop>", "<|system|>", "<|lstrip|>", "<|rstrip|>",
                                                        "<tool_call>", "word", " plus ", "the"])}


def o200k_extra_cases():
    return ["a word here", "words", "sword", "word", "word_x", "x word", "  <|lstrip|>  x", "x  <|rstrip|>  y",
            "a <|lstrip|><|rstrip|> b", "1 plus 2", "one plus two plus", "<tool_call>f<tool_call>", "the theme",
            "There the them", "<|endoftext|><|user|>hi<|assistant|>"]


# Split pre-tokenizers on their own (Oniguruma through HF's SysRegex), to check the C++ regex matcher's semantics
# beyond the two pre-tokenizer patterns: (pattern, behavior, invert).
REGEX_SPLITS = [("a+?", "isolated", False), ("a{2}", "isolated", False), ("a|ab", "isolated", False),
                ("ab|a", "isolated", False), ("a++a", "isolated", False), ("(?:ab)+c", "isolated", False),
                ("[a-c]+(?=d)", "isolated", False), (r"\p{Lu}\p{Ll}*", "isolated", False), (r"\d+", "isolated", False),
                (r"\h+", "isolated", False), ("^a|b$", "isolated", False), (r"\Aa|b\z", "isolated", False),
                (r"\w+", "isolated", False), (r"\s+", "isolated", False), (r"[^\s]+", "isolated", False),
                (r"(?i:strasse|k)", "isolated", False), (r"\P{L}+", "isolated", False),
                (r"[\p{N}\p{P}]+", "isolated", False), ("x*", "isolated", False), (".", "isolated", False),
                (r"[\x{4e00}-\x{9fff}]+", "isolated", False), (r"\s+(?!\S)|\s+", "isolated", False),
                ("-", "removed", False), ("-", "merged_with_previous", False), ("-", "merged_with_next", False),
                ("-", "contiguous", False), ("-", "removed", True), ("-", "isolated", True)]
REGEX_TEXTS = ["aaa", "aaaaa", "ab", "xababcx", "abcdabc", "HelloWorld", "a12b", "xx0aFz", "ab\nab",
               "Strasse STRASSE k K \u212a", "a-b-", "a--b", "-a-", "  x y\t\n", "日本語 text", "٣٤ 12 ½ ²",
               "é e\u0301 _x_", "x\u3000\u00a0y"]


def one_line(x):
    return json.dumps(x, ensure_ascii=False, separators=(",", ":"))


def main():
    if len(sys.argv) != 2:
        sys.exit("usage: make_tokenizer_goldens.py OUT_DIR")
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    import transformers
    from transformers import AutoTokenizer

    for name, (tok, specials) in variants().items():
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        if name == "hand":  # copied byte for byte (HF would write it back in its own format)
            src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer", "hand", "tokenizer.json")
            if os.path.abspath(src) != os.path.abspath(os.path.join(d, "tokenizer.json")):
                shutil.copyfile(src, os.path.join(d, "tokenizer.json"))
        else:
            tok.save(os.path.join(d, "tokenizer.json"))
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
                       "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces":
                       False}, f, indent=1, ensure_ascii=False)
        tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))  # what a reader of the file gets
        texts = test_corpus(specials, 40 if name == "hand" else 120) + (o200k_extra_cases() if name == "o200k" else [])
        cases = []
        for t in texts:
            enc = tok.encode(t)
            pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str(t)] if t else []
            cases.append({"text": t, "ids": enc.ids, "pieces": pieces,
                          "decoded": tok.decode(enc.ids, skip_special_tokens=False),
                          "decoded_skip_special": tok.decode(enc.ids, skip_special_tokens=True)})
        rng = random.Random(7)
        n = tok.get_vocab_size(with_added_tokens=True)
        decodes = []
        for i in range(60):
            ids = [rng.randrange(n) for _ in range(rng.randint(1, 12))]
            if i < 20:  # a few low ids (byte tokens in a trained vocabulary): partial UTF-8 sequences
                ids = [rng.randrange(min(n, 256)) for _ in range(rng.randint(1, 4))]
            decodes.append({"ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False),
                            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True)})
        with open(os.path.join(d, "cases.json"), "w") as f:
            f.write('{"encode": [\n' + ",\n".join(one_line(c) for c in cases) + '\n],\n"decode": [\n' +
                    ",\n".join(one_line(c) for c in decodes) + "\n]}\n")

        hf = AutoTokenizer.from_pretrained(d)
        chats = []
        for messages, gen, thinking in CHATS:
            kw = {} if thinking is None else {"enable_thinking": thinking}
            text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kw)
            chats.append({"messages": messages, "add_generation_prompt": gen, "enable_thinking": thinking,
                          "text": text, "ids": tok.encode(text).ids,
                          "hf_ids": list(hf(text, add_special_tokens=False)["input_ids"])})
        with open(os.path.join(d, "chat.json"), "w") as f:
            f.write("[\n" + ",\n".join(one_line(c) for c in chats) + "\n]\n")

    splits = []
    for pattern, behavior, invert in REGEX_SPLITS:
        pre = pre_tokenizers.Split(Regex(pattern), behavior=behavior, invert=invert)
        splits.append({"pattern": pattern, "behavior": behavior, "invert": invert,
                       "pieces": [[p for p, _ in pre.pre_tokenize_str(t)] for t in REGEX_TEXTS]})
    with open(os.path.join(out, "regex.json"), "w") as f:
        f.write('{"texts": ' + one_line(REGEX_TEXTS) + ',\n"splits": [\n' + ",\n".join(one_line(x) for x in splits) +
                "\n]}\n")

    with open(os.path.join(out, "VERSIONS"), "w") as f:
        f.write(f"tokenizers {tokenizers.__version__}\ntransformers {transformers.__version__}\n"
                f"python {sys.version.split()[0]}\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
