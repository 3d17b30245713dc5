"""Advanced 15 against the libraries people use: on the real SmolLM2 vocabulary (and Qwen3's,
under slow), the tokens our mask allows equal xgrammar's on random valid paths, and llguidance's
are a subset of ours (it only offers the token its tokenizer would produce where text is forced)."""
from __future__ import annotations

import pytest
import torch

from advanced.adv15_guided_decoding.dfa import compile_regex
from advanced.adv15_guided_decoding.json_schema import choice_regex
from advanced.adv15_guided_decoding.token_index import GuideState, TokenIndex, TokenVocab


# ---- differential: our masks against xgrammar's and llguidance's on the real SmolLM2 vocabulary --
DIFF_REGEXES = [r'\{"name":"[a-z ]{1,12}","age":(0|[1-9][0-9]{0,2}),"ok":(true|false)\}',
                choice_regex(["Paris", "London", "New York", "Rome"]),
                r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}( ext\. [0-9]{1,4})?"]   # llguidance's \d is any Unicode digit


@pytest.fixture(scope="module")
def smol_vocab(smol_tokenizer):
    from advanced.adv15_guided_decoding import reference
    n, eos = len(smol_tokenizer), [smol_tokenizer.eos_token_id]
    return (TokenVocab.from_hf(smol_tokenizer, n, eos), reference.xgrammar_compiler(smol_tokenizer, n, eos),
            reference.llguidance_tokenizer(smol_tokenizer, n, eos))


@pytest.fixture(scope="module")
def qwen3_vocab():
    from transformers import PreTrainedTokenizerFast

    from advanced.adv15_guided_decoding import reference
    from minivllm_support.models import qwen3_tokenizer_json
    tok = PreTrainedTokenizerFast(tokenizer_file=str(qwen3_tokenizer_json()))
    n, eos = 151936, [tok.convert_tokens_to_ids("<|im_end|>")]        # the model's vocab > the tokenizer's
    return (TokenVocab.from_hf(tok, n, eos), reference.xgrammar_compiler(tok, n, eos),
            reference.llguidance_tokenizer(tok, n, eos))


@pytest.mark.parametrize("regex", DIFF_REGEXES)
def test_allowed_tokens_equal_xgrammar_on_random_prefixes(smol_vocab, regex):
    _differential(smol_vocab, regex)


@pytest.mark.slow
@pytest.mark.parametrize("regex", DIFF_REGEXES)
def test_allowed_tokens_equal_xgrammar_on_qwen3_vocabulary(qwen3_vocab, regex):
    _differential(qwen3_vocab, regex)


def _differential(vocabs, regex: str) -> None:
    from advanced.adv15_guided_decoding.reference import LLGuidanceGuide, XgrammarGuide
    vocab, xgr_compiler, lltok = vocabs
    index = TokenIndex(compile_regex(regex), vocab)
    rng = torch.Generator().manual_seed(len(regex))
    for _ in range(2):                                     # random valid token paths to EOS
        ours, xg, ll = GuideState(index), XgrammarGuide(xgr_compiler, regex, vocab.vocab_size), \
            LLGuidanceGuide(lltok, regex, vocab.vocab_size)
        while not ours.finished:
            mask = ours.allowed()
            assert torch.equal(mask, xg.allowed()), (regex, ours.tokens)
            theirs = ll.allowed()
            assert not (theirs & ~mask).any(), "llguidance allows a token we refuse"
            allowed = mask.nonzero().flatten()
            token = int(allowed[torch.randint(len(allowed), (1,), generator=rng)])
            for guide in (ours, xg):
                guide.accept(token)
            if theirs[token]:
                ll.accept(token)
            else:                                           # a non-canonical token: llguidance's path ends
                ll = None
                break
