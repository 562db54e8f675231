#!/usr/bin/env python3
"""Compares `tpmoe tokenize` with Hugging Face `tokenizers` (the reference) on generated strings.

Trains small byte-level BPE tokenizers of three regex styles (GPT-2, cl100k / Llama 3, o200k / Qwen /
MiniMax-like) plus variants of their pre-tokenizers (prefix space, Digits, DeepSeek-like Split chains,
every Split behavior, invert) and added tokens (special and not, lstrip / rstrip / single_word), writes
each tokenizer.json to a temp dir, and checks on every one of them that
  - encode (no special tokens added) gives the same ids for every string,
  - decode gives the same text for the encodings and for random id sequences (invalid UTF-8 included),
  - the extra tokenizer.json files given (the C++ preset generator's) load in Hugging Face and match too.
Deterministic (seeded). Exit status 0 only if everything matches.

usage: compare_hf.py --cli PATH/TO/tpmoe [--extra NAME=tokenizer.json ...] [--strings N]
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import unicodedata

try:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
except ImportError:
    sys.exit("compare_hf.py needs Hugging Face tokenizers: python3 -m pip install tokenizers==0.22.1 "
             "(scripts/test.sh installs it)")

GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
CL100K = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
          r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
O200K = (r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
         r"""|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"""
         r"""|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
        r"""|\s+(?!\S)|\s+""")
DEEPSEEK_CJK = "[一-龥\u3040-ゟ゠-ヿ]+"
DEEPSEEK_MAIN = (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
                 r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

SPECIALS = ["<|endoftext|>", "]~b]", "[e~[", "]~!b[", "<think>", "</think>"]

WORDS = ("the of and to in is was that for it with as his on be at by had are but from or have an they which one "
         "you were all we her she there would their will when who him been has more if no out do so can what up "
         "said about other into than its time only could new them man some these then two first may any like now "
         "my such make over our even most me state after also made many did must before back see through way "
         "where get much go well your know should down work year because come people just say each those take day "
         "tokenizer merge vocabulary byte encoding decoder model expert parallel tensor throughput latency "
         "Hello World Python JSON HTTP NASA McDonald iPhone eBay O'Neil don't can't it's I'm we'll they've she'd "
         "CAPITAL LETTERS ALLCAPS CamelCase snake_case kebab-case").split()

SCRIPTS = [
    "你好，世界！今天天气很好。我们一起去公园散步吧。人工智能正在改变世界。",
    "こんにちは、世界。カタカナとひらがなを混ぜた文章です。東京は大きい都市です。",
    "안녕하세요 세계. 한국어 문장입니다. 토큰화 테스트를 합니다.",
    "Привет, мир! Это предложение на русском языке. Ёлка и ёж.",
    "Γειά σου Κόσμε! Ελληνικά γράμματα: αβγδεζηθικλμνξοπρστυφχψω.",
    "مرحبا بالعالم. هذه جملة باللغة العربية ١٢٣٤٥.",
    "שלום עולם. זה משפט בעברית.",
    "नमस्ते दुनिया। यह हिंदी में एक वाक्य है। १२३",
    "สวัสดีชาวโลก นี่คือประโยคภาษาไทย",
    "Xin chào thế giới. Tiếng Việt có nhiều dấu: ắ ằ ẳ ẵ ặ ề ổ ữ.",
    "Straße, Größe, Fußgänger, İstanbul, ıi, Ǆ ǅ ǆ, ﬁ ﬂ, Ω Å ℃ K",
    "Ünïcödé wïth dïäcrïtïcs: café naïve résumé coöperate São Paulo Kraków Ærø",
]

COMBINING = ["e\u0301", "a\u0308\u0323", "n\u0303", "\u0301", "\u0301\u0302\u0303abc", "Z\u0351\u0352\u0353\u0354",
             "o\u0338", "\u093f", "क\u093f", "\u05b8\u05b9", "ห\u0e31\u0e49", "ᄀ\u1161\u11a8", "x\u20dd", "\u200d",
             "a\u200cb", "\ufe0f", "1\ufe0f\u20e3"]

EMOJI = ["😀", "👍🏽", "👨\u200d👩\u200d👧\u200d👦", "🇫🇷🇯🇵", "❤️", "🏳️\u200d🌈", "🤖🧠💡", "😀😀😀", "✨", "🙏🏿",
         "🔥 fire", "emoji😀inside", "(╯°□°)╯︵ ┻━┻", "¯\\_(ツ)_/¯"]

CODE = [
    "def f(x):\n    return x * 2\n",
    "int main(int argc, char** argv) {\n\treturn 0;\n}\n",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "for (size_t i = 0; i < n; ++i) sum += a[i] * b[i];",
    "    if x == y:\n        print('equal')\n    else:\n        pass",
    "<html><body><div class=\"x\">text</div></body></html>",
    "SELECT * FROM users WHERE id = 42 AND name LIKE '%bob%';",
    "$ ls -la /usr/local/bin | grep -v '^d' && echo \"done\"",
    "x+=1;y-=2;z*=3;w/=4;a%=5;b<<=6;c>>=7;d&&e||f",
    "https://example.com/path/to/page?query=1&other=two#frag",
    "// comment\n/* block */\n# hash\n-- sql\n",
]

WHITESPACE = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", "\r\n\r\n", " \n ", "\u00a0", "\u3000", "\u2028",
              "\u2029", "\u0085", "\u180e", "\u2003\u2009", "\x0b", "\x0c", " \t \n", "    \n    ", "\n   \n",
              "\u200b", "\ufeff"]

DIGITS = ["0", "7", "42", "123", "1234", "12345", "1234567890", "3.14159", "1,000,000", "-273.15", "1e-9", "0x1F",
          "١٢٣", "۴۵۶", "१२३", "²³", "½¼", "Ⅻ", "１２３", "๑๒๓", "2024-01-15", "10:30"]

SPECIAL_TEXT = ["<|endoftext|>", "]~b]user\n", "[e~[", "]~!b[", "<think>", "</think>", "<think", "think>", "<thin",
                "<<think>>", "a<think>b", "]~b]]~b]", "[e~[[e~[", "<|endoftext", "|endoftext|>", "<mask>", " <mask> ",
                "hello", " hello ", "xhello", "helloy", "_hello", "hello_", "<|begin_of_text|>", "<|eot_id|>"]

CONTROL = ["\x00", "\x01", "\x1b[31m", "\x7f", "\x80", "\u0000abc", "\ufffd", "\U0010fffd", "\ue000"]

POOLS = [WORDS, SCRIPTS, COMBINING, EMOJI, CODE, WHITESPACE, DIGITS, SPECIAL_TEXT, CONTROL]


def random_codepoint(rng):
    """A random assigned, non-surrogate code point (Unicode 14, what Python 3.11 and PCRE2 10.42 know)."""
    ranges = [(0x20, 0x7f), (0xa0, 0x24f), (0x370, 0x3ff), (0x400, 0x4ff), (0x590, 0x6ff), (0x900, 0x97f),
              (0xe00, 0xe7f), (0x1100, 0x11ff), (0x1e00, 0x1fff), (0x2000, 0x206f), (0x20a0, 0x214f),
              (0x2190, 0x23ff), (0x2500, 0x27bf), (0x3000, 0x30ff), (0x4e00, 0x9fff), (0xac00, 0xd7a3),
              (0xff00, 0xffef), (0x1f300, 0x1f6ff), (0x1d400, 0x1d7ff), (0x20000, 0x2a6df)]
    while True:
        lo, hi = rng.choice(ranges)
        c = chr(rng.randint(lo, hi))
        if unicodedata.category(c) not in ("Cn", "Cs"):
            return c


def random_string(rng):
    kind = rng.random()
    if kind < 0.03:
        return ""
    if kind < 0.10:
        return "".join(random_codepoint(rng) for _ in range(rng.randint(1, 12)))
    if kind < 0.12:  # longer text
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 150)))
    if kind < 0.25:  # English-like sentence
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, 20))]
        s = " ".join(words)
        return s[0].upper() + s[1:] + rng.choice([".", "!", "?", "", "...", ",", ";"])
    parts = []
    for _ in range(rng.randint(1, 8)):
        pool = rng.choice(POOLS)
        piece = rng.choice(pool)
        if pool is SCRIPTS and rng.random() < 0.5:
            a = rng.randrange(len(piece))
            piece = piece[a:a + rng.randint(1, 12)]
        parts.append(piece)
        if rng.random() < 0.5:
            parts.append(rng.choice([" ", "", "\n", "  ", "\t", ", ", "'s ", "'LL "]))
    return "".join(parts)


def train_model(ignore_merges, pre_tokenizer, corpus, vocab_size, specials):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


def split(pattern, behavior="isolated", invert=False):
    return pre_tokenizers.Split(Regex(pattern), behavior, invert=invert)


def byte_level(prefix=False, regex=False):
    return pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=regex)


def build_tokenizers(rng):
    corpus = [random_string(rng) for _ in range(3000)]
    out = {}

    gpt2 = train_model(False, byte_level(regex=True), corpus, 2500, ["<|endoftext|>"])
    gpt2.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    gpt2.post_processor = processors.ByteLevel(trim_offsets=False)
    out["gpt2"] = gpt2.to_str()

    # Same model, prefix space, and added tokens that strip or must be single words.
    t = Tokenizer.from_str(out["gpt2"])
    t.pre_tokenizer = byte_level(prefix=True, regex=True)
    t.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True), AddedToken("[e~[", rstrip=True)])
    t.add_tokens([AddedToken("hello", single_word=True, normalized=True),
                  AddedToken("]~b]", lstrip=True, rstrip=True, normalized=False)])
    out["gpt2-prefix-strip-single-word"] = t.to_str()

    cl = train_model(True, pre_tokenizers.Sequence([split(CL100K), byte_level()]), corpus, 3000,
                     ["<|begin_of_text|>", "<|eot_id|>"])
    cl.add_special_tokens(["<think>", "</think>"])
    cl.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[
        ("<|begin_of_text|>", 0)])
    out["cl100k-llama3"] = cl.to_str()

    o2 = train_model(False, pre_tokenizers.Sequence([split(O200K), byte_level()]), corpus, 3000, [])
    o2.add_special_tokens(SPECIALS)
    out["o200k-minimax"] = o2.to_str()

    variants = {
        "qwen-digits": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), split(QWEN),
                                                byte_level()]),
        "deepseek-chain": pre_tokenizers.Sequence([split(r"\p{N}{1,3}"), split(DEEPSEEK_CJK), split(DEEPSEEK_MAIN),
                                                   byte_level()]),
        "digits-contiguous-prefix": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=False),
                                                             byte_level(prefix=True, regex=True)]),
        "split-removed": pre_tokenizers.Sequence([split(r"\s+", "removed"), byte_level(regex=True)]),
        "split-merged-prev": pre_tokenizers.Sequence([split(r"[\p{P}\s]", "merged_with_previous"), byte_level()]),
        "split-merged-next": pre_tokenizers.Sequence([split(r"\s+", "merged_with_next"), byte_level()]),
        "split-contiguous": pre_tokenizers.Sequence([split(r"\p{L}", "contiguous"), byte_level()]),
        "split-invert": pre_tokenizers.Sequence([split(r"\p{L}+|\s+", "isolated", invert=True), byte_level()]),
        "split-string": pre_tokenizers.Sequence([pre_tokenizers.Split(", ", "removed"), byte_level(regex=True)]),
    }
    encode_only = set()
    for name, pre in variants.items():
        t = Tokenizer.from_str(out["o200k-minimax"])
        t.pre_tokenizer = pre
        out[name] = t.to_str()
        encode_only.add(name)  # same vocab and added tokens as o200k-minimax: decoding is the same
    return out, encode_only


def run_cli(cli, path, lines, decode=False):
    args = [cli, "tokenize", "--tokenizer", path] + (["--decode"] if decode else [])
    r = subprocess.run(args, input="".join(json.dumps(x) + "\n" for x in lines).encode(), capture_output=True,
                       timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({r.returncode}): {r.stderr.decode(errors='replace')[:2000]}")
    return [json.loads(line) for line in r.stdout.decode().split("\n") if line]


INVALID_BYTE_SEQUENCES = [[0x80], [0xbf, 0x41], [0xc0, 0x80], [0xc2], [0xc2, 0x41], [0xe4, 0xbd], [0xe4, 0xbd, 0x41],
                          [0xed, 0xa0, 0x80], [0xf0, 0x9f, 0x98], [0xf0, 0x9f, 0x98, 0x41], [0xf4, 0x90, 0x80, 0x80],
                          [0xf5, 0x41], [0xff, 0xfe], [0xe0, 0x80, 0x80], [0xf0, 0x80], [0xe4, 0xbd, 0xa0, 0xbd]]


def compare(name, tok_json, cli, strings, rng, workdir, with_decode):
    path = os.path.join(workdir, name + ".json")
    with open(path, "w", encoding="utf-8") as f:
        f.write(tok_json)
    tok = Tokenizer.from_file(path)  # the file must load in Hugging Face
    failures = []

    want = [e.ids for e in tok.encode_batch(strings, add_special_tokens=False)]
    got = run_cli(cli, path, strings)
    for s, w, g in zip(strings, want, got):
        if w != g:
            failures.append(f"encode {s!r}: hf {w} tpmoe {g}")
    if len(got) != len(strings):
        failures.append(f"encode: {len(got)} output lines for {len(strings)} inputs")

    if not with_decode:
        return len(strings), 0, failures
    # Decode: the encodings, random id sequences, and byte tokens that make invalid UTF-8.
    vocab = tok.get_vocab(with_added_tokens=True)
    size = max(vocab.values()) + 1
    byte_ids = [vocab[c] for c in pre_tokenizers.ByteLevel.alphabet() if c in vocab]
    alphabet = {b: c for b, c in zip(range(256), bytes_to_unicode())}
    id_lists = [ids for ids in want if ids][:4000]
    id_lists += [[rng.randrange(size) for _ in range(rng.randint(1, 24))] for _ in range(1500)]
    id_lists += [[rng.choice(byte_ids) for _ in range(rng.randint(1, 8))] for _ in range(500)]
    for seq in INVALID_BYTE_SEQUENCES:
        id_lists.append([vocab[alphabet[b]] for b in seq])
        id_lists.append(want[1][:3] + [vocab[alphabet[b]] for b in seq] + want[1][:3] if len(want) > 1 else [])
    id_lists = [ids for ids in id_lists if ids]
    want_text = [tok.decode(ids, skip_special_tokens=False) for ids in id_lists]
    got_text = run_cli(cli, path, id_lists, decode=True)
    for ids, w, g in zip(id_lists, want_text, got_text):
        if w != g:
            failures.append(f"decode {ids}: hf {w!r} tpmoe {g!r}")
    if len(got_text) != len(id_lists):
        failures.append(f"decode: {len(got_text)} output lines for {len(id_lists)} inputs")
    return len(strings), len(id_lists), failures


def bytes_to_unicode():
    """GPT-2's byte -> character table, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cli", required=True)
    ap.add_argument("--extra", action="append", default=[], help="NAME=path/to/tokenizer.json")
    ap.add_argument("--strings", type=int, default=10000, help="strings per base tokenizer")
    ap.add_argument("--variant-strings", type=int, default=2500,
                    help="strings per pre-tokenizer variant (the first ones of the same list)")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    rng = random.Random(args.seed)
    tokenizers, encode_only = build_tokenizers(rng)
    for extra in args.extra:
        name, path = extra.split("=", 1)
        with open(path, encoding="utf-8") as f:
            tokenizers[name] = f.read()
    strings = [random_string(rng) for _ in range(args.strings)]
    total_enc = total_dec = 0
    failed = False
    with tempfile.TemporaryDirectory(prefix="tpmoe-tok-") as workdir:
        for name, tok_json in tokenizers.items():
            variant = name in encode_only
            n_enc, n_dec, failures = compare(name, tok_json, args.cli, strings[:args.variant_strings] if variant
                                             else strings, rng, workdir, not variant)
            total_enc += n_enc
            total_dec += n_dec
            status = "ok" if not failures else f"{len(failures)} MISMATCHES"
            print(f"{name:32s} encode {n_enc:6d} strings, decode {n_dec:5d} id lists: {status}", flush=True)
            for f in failures[:8]:
                print("   ", f[:600])
            failed = failed or bool(failures)
    print(f"total: {total_enc} encodes and {total_dec} decodes over {len(tokenizers)} tokenizers: "
          f"{'MISMATCH' if failed else 'all match Hugging Face tokenizers'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
