"""The decoding round: plan, draft, verify, commit, for a whole batch."""
