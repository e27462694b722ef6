"""Draft sources beside the DFlash drafter that cost no model: prompt lookup (``ngram``) and suffix lookup
(``suffix``), with the offline τ evaluator the held-out evaluation reports them by (:mod:`.lookup`)."""
from adaflash_ray.drafting.lookup import (MAX_DRAFT, ContextIndex, LookupState, PromptLookup, Proposal, Proposer,
                                          SuffixCorpus, SuffixLookup, SuffixState, greedy_verify_steps, lookup_tau,
                                          lookup_tau_by_domain)

__all__ = ["MAX_DRAFT", "ContextIndex", "LookupState", "PromptLookup", "Proposal", "Proposer", "SuffixCorpus",
           "SuffixLookup", "SuffixState", "greedy_verify_steps", "lookup_tau", "lookup_tau_by_domain"]
