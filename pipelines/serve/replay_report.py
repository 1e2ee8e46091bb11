"""The replay's report: per serving node, summed over nodes, and as text.

A node's part (:func:`node_report`) takes the cache's counts from its store's
``KVStore.stats()`` alone (each lookup a full reuse, a partial reuse or a miss, hits per
tier, invalidated; resident bytes, offloads, drops) and the replay's own tallies (requests,
equality against the full recompute and the training forward, tokens encoded, peak resident
bytes, the loss). :func:`report` sums the nodes (rates recomputed from the summed counts, as
``stats()`` computes them) and adds what ran and the wall-clock figures, all under
``timing`` (so two replays with the same arguments give the same report outside it);
:func:`report_text` is the report for a person. docs/serving.md lists the fields.

Example::

    rep = node_report(0, store.stats(), users=3, requests=10, impressions=40, requests_without_history=1,
                      equality=eq, tokens=tok, peak_resident_bytes=peak, loss={"sum": 5.0, "count": 40})
    print(report_text(report(trace, [rep], [timing], desc=desc, tol=1e-9, cache=cache, read_s=0.1,
                             wall_s=2.0, device="cpu")))
"""

from __future__ import annotations

from userwise.pipelines.serve.store import TIERS

__all__ = ["node_report", "report", "report_text", "order_summary"]

MB = 1 << 20
# the report's cache counts, as KVStore.stats() gives them (see its docstring)
_COUNTS = ("lookups", "reuse", "reuse_rate", "hits", "hit_rate", "partial_reuses", "misses", "invalidated")


def node_report(node: int, stats: dict, *, users: int, requests: int, impressions: int, requests_without_history: int,
                equality: dict, tokens: dict, peak_resident_bytes: dict, loss: dict) -> dict:
    """One serving node's part of the report: ``stats`` is its store's ``KVStore.stats()`` after
    its last request (the cache's counts, resident bytes, offloads, drops); ``tokens`` the
    events the full recompute and the cache encoded (``full``, ``encoded`` = ``new`` +
    ``reencoded``); ``loss`` the cached logits' summed cross-entropy and its count (turned into
    ``logloss`` by :func:`report`)."""
    return {
        "node": node, "users": users, "requests": requests, "impressions": impressions,
        "requests_without_history": requests_without_history,
        "equality": equality,
        **{k: stats[k] for k in _COUNTS},
        "tokens": {**tokens, "recomputed_fraction": tokens["encoded"] / tokens["full"] if tokens["full"] else 0.0},
        "resident_bytes": stats["resident_bytes"], "peak_resident_bytes": peak_resident_bytes,
        "offloaded": {k: stats[f"offloaded_{k}"] for k in ("device_to_host", "device_to_disk", "host_to_disk")},
        "dropped": stats["dropped"], "not_stored": stats["not_stored"],
        "loss": loss,
    }


def report(trace, nodes: list, timing: list, *, desc, tol, cache, read_s, wall_s, device) -> dict:
    """The report of a replay of ``trace`` (a :class:`~userwise.pipelines.serve.trace.Trace`)
    from its nodes' :func:`node_report` and their timing (``cached_s``, ``full_s``): totals,
    then ``nodes`` and ``timing``."""
    total = lambda key: sum(n[key] for n in nodes)  # noqa: E731
    lookups = total("lookups")
    counts = {k: ({t: sum(n[k][t] for n in nodes) for t in nodes[0][k]} if nodes and isinstance(nodes[0][k], dict)
                  else total(k)) for k in _COUNTS if not k.endswith("_rate")}
    counts["reuse_rate"] = {k: v / max(lookups, 1) for k, v in counts["reuse"].items()}  # as stats() gives them
    counts["hit_rate"] = {t: v / max(lookups, 1) for t, v in counts["hits"].items()}
    tok = {k: sum(n["tokens"][k] for n in nodes) for k in ("full", "encoded", "new", "reencoded")}
    tok["recomputed_fraction"] = tok["encoded"] / tok["full"] if tok["full"] else 0.0
    eq = {"tolerance": tol,
          "max_abs_diff": max((n["equality"]["max_abs_diff"] for n in nodes), default=0.0),
          "over_tolerance": sum(n["equality"]["over_tolerance"] for n in nodes)}
    trained = [n["equality"] for n in nodes if n["equality"]["over_tolerance_training"] is not None]
    if trained or not nodes:  # None: not compared (the action-time order: training holds the stored order)
        eq["max_abs_diff_training"] = max((e["max_abs_diff_training"] for e in trained), default=0.0)
        eq["over_tolerance_training"] = sum(e["over_tolerance_training"] for e in trained)
    else:
        eq["max_abs_diff_training"] = eq["over_tolerance_training"] = None
    eq["equal"] = eq["over_tolerance"] == 0 and not eq["over_tolerance_training"]
    loss_sum, loss_n = sum(n["loss"]["sum"] for n in nodes), sum(n["loss"]["count"] for n in nodes)
    for n in nodes:
        c = n.pop("loss")
        n["logloss"] = c["sum"] / c["count"] if c["count"] else None
    cached_s, full_s = sum(t["cached_s"] for t in timing), sum(t["full_s"] for t in timing)
    requests = total("requests")
    for t, n in zip(timing, nodes):
        t.update(cached_requests_per_s=_rate(n["requests"], t["cached_s"]),
                 full_requests_per_s=_rate(n["requests"], t["full_s"]),
                 cached_s=round(t["cached_s"], 3), full_s=round(t["full_s"], 3))
    return {
        "shards": trace.root, "training_nodes": trace.training_nodes, "sets": trace.sets,
        "serving_nodes": trace.serving_nodes, "model": desc, "cache": cache,
        "samples": len(trace.sample_ids), "users": total("users"), "requests": requests,
        "impressions": total("impressions"), "requests_without_history": total("requests_without_history"),
        "equality": eq, **counts, "tokens": tok,
        "resident_bytes": {t: sum(n["resident_bytes"][t] for n in nodes) for t in TIERS},
        "logloss": loss_sum / loss_n if loss_n else None,
        "nodes": nodes,
        "timing": {"device": str(device), "cached_s": round(cached_s, 3), "full_s": round(full_s, 3),
                   "cached_requests_per_s": _rate(requests, cached_s), "full_requests_per_s": _rate(requests, full_s),
                   "speedup": round(full_s / cached_s, 2) if cached_s > 0 else None, "read_s": round(read_s, 3),
                   "wall_s": round(wall_s, 3), "nodes": timing},
    }



def order_summary(r: dict, *, late_events: int) -> dict:
    """What an order costs the cache, from a :func:`report`: full reuse (``hit_rate``: the share
    of lookups that served the whole held state), partial reuse and misses, ``invalidated``
    lookups, ``tokens`` encoded (``new``, ``reencoded``, ``recomputed_fraction``), ``equality``
    against the full recompute; ``late_events`` (the trace's events that arrived after one of a
    later action time)."""
    eq = r["equality"]
    return {"late_events": late_events, "requests": r["requests"], "lookups": r["lookups"],
            "hit_rate": r["reuse_rate"]["full"], "partial_rate": r["reuse_rate"]["partial"],
            "miss_rate": r["reuse_rate"]["miss"], "invalidated": r["invalidated"],
            "tokens": dict(r["tokens"]),
            "equality": {"max_abs_diff": eq["max_abs_diff"], "over_tolerance": eq["over_tolerance"],
                         "equal": eq["over_tolerance"] == 0}}


def _rate(n: int, s: float) -> float | None:
    return round(n / s, 1) if s > 0 else None



def report_text(r: dict) -> str:
    """The report for a person: the totals, then one line per serving node."""
    eq, hr, rr, tk, tm, m = r["equality"], r["hit_rate"], r["reuse_rate"], r["tokens"], r["timing"], r["model"]
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    mib = lambda b: f"{b / MB:.1f} MiB"  # noqa: E731
    lines = [
        f"replayed {r['requests']:,} requests ({r['impressions']:,} impressions, {r['users']:,} users, "
        f"{r['samples']:,} samples) of {r['shards']} on {r['serving_nodes']} serving node(s)",
        f"model: {m['encoder']} encoder, {m['layers']} layers, dim {m['dim']}, {m['dtype']}, L={m['max_seq_len']}, "
        f"version {m['version']}",
        f"logits equal: {'yes' if eq['equal'] else 'NO'} (max |cached - full recompute| {eq['max_abs_diff']:.3g}, "
        + (f"|cached - training| {eq['max_abs_diff_training']:.3g}, " if eq["max_abs_diff_training"] is not None
           else "not compared with training (held by action time), ")
        + f"tolerance {eq['tolerance']:g}; {eq['over_tolerance']} over)",
        f"reuse: full {pct(rr['full'])} (device {pct(hr['device'])}, host {pct(hr['host'])}, disk "
        f"{pct(hr['disk'])}), partial {pct(rr['partial'])}, miss {pct(rr['miss'])} of {r['lookups']:,} lookups "
        f"({r['invalidated']:,} invalidated; {r['requests_without_history']:,} requests without history)",
        f"tokens recomputed: {pct(tk['recomputed_fraction'])} ({tk['encoded']:,} encoded of the {tk['full']:,} a full "
        f"recompute encodes: {tk['new']:,} new, {tk['reencoded']:,} encoded again)",
        f"resident: device {mib(r['resident_bytes']['device'])}, host {mib(r['resident_bytes']['host'])}, disk "
        f"{mib(r['resident_bytes']['disk'])}",
        f"requests per second: cached {tm['cached_requests_per_s']}, full recompute {tm['full_requests_per_s']} "
        f"({tm['speedup']}x) on {tm['device']}",
    ]
    for name, o in (r.get("orders") or {}).items():
        t = o["tokens"]
        lines.append(f"order {name}: full reuse {pct(o['hit_rate'])}, partial {pct(o['partial_rate'])}, "
                     f"{o['invalidated']:,} invalidated, {t['reencoded']:,} tokens encoded again "
                     f"({pct(t['recomputed_fraction'])} recomputed), cached = full recompute: "
                     f"{'yes' if o['equality']['equal'] else 'NO'} (max diff {o['equality']['max_abs_diff']:.3g}); "
                     f"{o['late_events']:,} late events")
    for n in r["nodes"]:
        h = n["hit_rate"]
        lines.append(f"  node {n['node']}: {n['requests']:,} requests, {n['users']:,} users, full reuse "
                     f"{pct(n['reuse_rate']['full'])} (device/host/disk {pct(h['device'])}/{pct(h['host'])}/"
                     f"{pct(h['disk'])}), partial {pct(n['reuse_rate']['partial'])}, recomputed "
                     f"{pct(n['tokens']['recomputed_fraction'])}, peak resident "
                     f"{mib(sum(n['peak_resident_bytes'].values()))}, max diff {n['equality']['max_abs_diff']:.3g}")
    return "\n".join(lines)
