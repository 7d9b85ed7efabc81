"""Texts and conversations shared by the tokenizer and detokenizer tests."""

from __future__ import annotations

VARIED = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, internal   runs, and trailing  ",
    "tabs\tand\ttabs\t\tand\nnewlines\n\n\nend",
    "Ünïcödé café naïve — “quotes” «guillemets»",
    "emoji 😀🚀👨‍👩‍👧 and CJK 你好，世界 こんにちは 안녕하세요",
    "Hello 12345 world 3.14159 -42 1e10",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(3))",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after<file_sep>more",
    "don't can't I'M we'll they've it's",
    "https://example.com/path?q=1&r=two#frag",
    "",
    " ",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why? 🤔"},
    ],
]

MULTIBYTE = "Sure! 😀🚀 你好，世界 — naïve café. 👨‍👩‍👧 Привет 안녕 done"
