"""Structured output and forced tool calls with llguidance (docs/grammar.md)."""
from dsv41.grammar.compile import GrammarError, GrammarSpec, Vocab, compile_request, llg_tokenizer, vocab_for
from dsv41.grammar.matchers import Matcher, allocate_bitmask, apply_mask, fill_draft_masks, fill_masks

__all__ = ["GrammarError", "GrammarSpec", "Matcher", "Vocab", "allocate_bitmask", "apply_mask", "compile_request",
           "fill_draft_masks", "fill_masks", "llg_tokenizer", "vocab_for"]
