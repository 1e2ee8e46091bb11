"""One request served the way a serving loop does it, for tests that serve many: the store's
lease for the user's current chain, a prefill (a miss) or an extend by the events it lacks,
the state put back, the candidates scored; and the full recompute beside it."""

from __future__ import annotations


def serve_and_recompute(store, model, user, cur, cands, *, max_seq_len: int, page_size: int):
    """Serve ``cands`` for ``user`` holding the events ``cur`` through ``store``; return
    (cached logits, full-recompute logits, the length the lease held)."""
    from userwise.pipelines.serve import chain_of, extend, full_scores, prefill, score

    chain = chain_of(cur, block=page_size, version="v")
    with store.acquire(user, chain, max_seq_len=max_seq_len) as lease:
        held = lease.length
        st = prefill(model, cur, max_seq_len=max_seq_len, page_size=page_size) if lease.state is None \
            else extend(model, lease.state, cur[lease.length:])
        store.put(user, chain, st)
        cached = score(model, st, cands)
    return cached, full_scores(model, cur, cands, max_seq_len), held
