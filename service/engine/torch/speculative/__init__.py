"""Speculative decoding in the torch engine: proposals (prompt lookup, a draft model), their
verification by rejection sampling, and the back-off that stops proposing where nothing is accepted.

The flow, inside continuous batching:
  1. before a step is scheduled, the core asks the proposer for each decoding request's draft
     tokens (`Request.draft_token_ids`; none for a request backing off or that cannot speculate;
     a lone request's prompt-lookup drafts as many as draft_length.py expects to pay for the rows);
  2. the scheduler schedules a speculating request's last token and its drafts as one chunk (their
     KV blocks taken like any other), beside plain decodes and prompt chunks in the same step;
  3. the runner computes logits at every position of that chunk and verifies the drafts
     (service.engine.torch.speculative.rejection): the accepted drafts and one token more come back;
  4. the core emits them, counts the accepted tokens as computed (`Scheduler.accept_drafts`: blocks
     that became full are published, the blocks of rejected tokens freed) and records acceptance.
"""
