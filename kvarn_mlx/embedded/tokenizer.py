"""A transformers fast tokenizer rebuilt from GGUF tokenizer metadata with the
`tokenizers` library (transformers' own GGUF tokenizer path imports torch):
byte-level BPE ("gpt2" vocabularies) and sentencepiece BPE ("llama")."""


def _special_tokens(metadata, tokens):
    from tokenizers import AddedToken

    # Token type 3 is control (special), 4 is user-defined (added, not
    # special). Both are always matched whole in the text, never split.
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    return [
        AddedToken(tokens[i], special=(t == 3), normalized=False)
        for i, t in enumerate(types)
        if t in (3, 4)
    ]


_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_bpe(metadata):
    """llama.cpp "gpt2" vocabularies: byte-level BPE with merges."""
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in metadata["tokenizer.ggml.merges"]]
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=merges,
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    pre = metadata.get("tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # llama.cpp "smollm": each digit alone, then the GPT-2 regex. This is
        # HF SmolLM2's tokenizer.json: Sequence[Digits(individual), ByteLevel].
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre == "qwen2":
        # llama.cpp "qwen2": digits one by one, letters with one leading
        # non-letter, punctuation runs, then byte-level without its own regex.
        # This is HF Qwen2's tokenizer.json (with its NFC normalizer).
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif pre in ("gpt2", "default"):
        tok.pre_tokenizer = byte_level
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported")
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _sentencepiece_merges(tokens, scores, types):
    """BPE merges equivalent to sentencepiece's BPE encoding: every split of a
    normal token into two vocabulary tokens, best token score first.
    Sentencepiece merges the adjacent pair whose concatenation scores highest;
    ranking each pair by the score of what it makes gives the same order."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty != 1:
            continue
        for k in range(1, len(t)):
            if t[:k] in vocab and t[k:] in vocab:
                ranked.append((-scores[i], i, k))
    ranked.sort()
    return [(tokens[i][:k], tokens[i][k:]) for _, i, k in ranked]


def _sentencepiece_bpe(metadata):
    """llama.cpp "llama" vocabularies: sentencepiece BPE (tokens with scores,
    no merges), spaces written as U+2581, byte fallback."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        # llama.cpp prepends the space to the first text fragment only, which
        # a tokenizers normalizer cannot express.
        raise ValueError("sentencepiece GGUF tokenizers with add_space_prefix are not supported")
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)},
            merges=_sentencepiece_merges(tokens, metadata["tokenizer.ggml.scores"], types),
            unk_token=None if unk is None else tokens[unk],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok


_VOCAB_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def build_tokenizer(metadata):
    """A transformers fast tokenizer from GGUF tokenizer metadata."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    vocab_type = metadata.get("tokenizer.ggml.model")
    if vocab_type not in _VOCAB_BUILDERS:
        raise ValueError(
            f"GGUF tokenizer {vocab_type!r} is not supported (supported: gpt2 byte-level "
            "BPE, llama sentencepiece BPE)"
        )
    tokens = metadata["tokenizer.ggml.tokens"]
    tok = _VOCAB_BUILDERS[vocab_type](metadata)
    tok.add_tokens(_special_tokens(metadata, tokens))

    def token(key):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return None if token_id is None else tokens[token_id]

    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    if add_bos:
        bos = token("bos")
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A",
            pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, tokens.index(bos))],
        )
    arch = metadata.get("general.architecture")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=token("bos"),
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=metadata.get("tokenizer.chat_template"),
        add_bos_token=add_bos,
        clean_up_tokenization_spaces=False,
        model_max_length=metadata.get(f"{arch}.context_length", 8192),
    )
