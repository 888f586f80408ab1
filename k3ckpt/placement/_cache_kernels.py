"""numba kernels of the cache simulators in ``cache.py``.

Each kernel has a plain-Python reference with the same signature in ``cache.py``
(``lru_hits_ref``, ``lfu_hits_ref``, ``belady_hits_ref``, ``hot_recent_hits_ref``,
``recent_freq_hits_ref``); tests hold them equal hit for hit.  Imported lazily: numba loads only when a simulation runs.

Common signature: ``(keys int64[n], capacity, initial int64[m], nkeys) -> bool[n]``.
``initial`` is the warm content, inserted in order (the last is the most recent).
"""

from __future__ import annotations

import numpy as np

from .._numba import njit


@njit
def lru_hits(keys, capacity, initial, nkeys):
    n = keys.shape[0]
    hits = np.zeros(n, dtype=np.bool_)
    if capacity <= 0:
        return hits
    head = nkeys  # sentinels: head.next = most recent, tail.prev = least recent
    tail = nkeys + 1
    nxt = np.full(nkeys + 2, -1, dtype=np.int64)
    prv = np.full(nkeys + 2, -1, dtype=np.int64)
    nxt[head] = tail
    prv[tail] = head
    inside = np.zeros(nkeys, dtype=np.bool_)
    size = 0
    for j in range(initial.shape[0] + n):
        if j < initial.shape[0]:
            k = initial[j]
        else:
            k = keys[j - initial.shape[0]]
        if inside[k]:
            if j >= initial.shape[0]:
                hits[j - initial.shape[0]] = True
            # unlink
            nxt[prv[k]] = nxt[k]
            prv[nxt[k]] = prv[k]
        else:
            if size == capacity:
                victim = prv[tail]
                nxt[prv[victim]] = tail
                prv[tail] = prv[victim]
                inside[victim] = False
                size -= 1
            inside[k] = True
            size += 1
        # link at head
        nxt[k] = nxt[head]
        prv[k] = head
        prv[nxt[head]] = k
        nxt[head] = k
    return hits


@njit
def _push(heap, size, value):
    i = size
    heap[i] = value
    while i > 0:
        p = (i - 1) >> 1
        if heap[p] <= heap[i]:
            break
        heap[p], heap[i] = heap[i], heap[p]
        i = p
    return size + 1


@njit
def _pop(heap, size):
    top = heap[0]
    size -= 1
    heap[0] = heap[size]
    i = 0
    while True:
        l = 2 * i + 1
        if l >= size:
            break
        c = l
        if l + 1 < size and heap[l + 1] < heap[l]:
            c = l + 1
        if heap[i] <= heap[c]:
            break
        heap[i], heap[c] = heap[c], heap[i]
        i = c
    return top, size


@njit
def lfu_hits(keys, capacity, initial, nkeys):
    # evict the lowest (count, last use); counts persist after eviction ("perfect
    # LFU"); warm keys start with count 0.  A heap entry is the time of the access
    # that pushed it, ordered by (count then, time); it is stale once its key was
    # touched again or left.
    n = keys.shape[0]
    m = initial.shape[0]
    hits = np.zeros(n, dtype=np.bool_)
    if capacity <= 0:
        return hits
    count = np.zeros(nkeys, dtype=np.int64)
    last = np.full(nkeys, -1, dtype=np.int64)
    inside = np.zeros(nkeys, dtype=np.bool_)
    ent_key = np.empty(m + n, dtype=np.int64)
    heap = np.empty(m + n + 1, dtype=np.int64)
    hsize = 0
    size = 0
    span = m + n + 1
    for j in range(m + n):
        k = initial[j] if j < m else keys[j - m]
        if j >= m:
            count[k] += 1
        if inside[k]:
            if j >= m:
                hits[j - m] = True
        else:
            if size == capacity:
                while True:
                    top, hsize = _pop(heap, hsize)
                    t = top % span
                    v = ent_key[t]
                    if inside[v] and last[v] == t:
                        break
                inside[v] = False
                size -= 1
            inside[k] = True
            size += 1
        last[k] = j
        ent_key[j] = k
        hsize = _push(heap, hsize, count[k] * span + j)
    return hits


@njit
def belady_hits(keys, capacity, initial, nkeys, bypass):
    # MIN: on a miss the resident needed farthest in the future leaves (ties: the
    # larger key).  With ``bypass`` the new key competes too and is not admitted
    # when it is needed last (ties: not admitted).
    n = keys.shape[0]
    m = initial.shape[0]
    hits = np.zeros(n, dtype=np.bool_)
    if capacity <= 0:
        return hits
    never = n  # next use beyond the trace
    nxt = np.empty(n, dtype=np.int64)
    seen = np.full(nkeys, never, dtype=np.int64)
    for t in range(n - 1, -1, -1):
        nxt[t] = seen[keys[t]]
        seen[keys[t]] = t
    first = seen  # first use of every key (never if unused)
    cur = np.full(nkeys, -1, dtype=np.int64)  # next use of resident keys
    inside = np.zeros(nkeys, dtype=np.bool_)
    heap = np.empty(m + n + 1, dtype=np.int64)  # max-heap via negated (next * nkeys + key)
    hsize = 0
    size = 0
    for j in range(m):
        k = initial[j]
        if inside[k]:
            continue
        if size == capacity:
            while True:
                top, hsize = _pop(heap, hsize)
                v = (-top) % nkeys
                if inside[v] and (-top) // nkeys == cur[v]:
                    break
            inside[v] = False
            size -= 1
        inside[k] = True
        cur[k] = first[k]
        size += 1
        hsize = _push(heap, hsize, -(cur[k] * nkeys + k))
    for t in range(n):
        k = keys[t]
        if inside[k]:
            hits[t] = True
            cur[k] = nxt[t]
            hsize = _push(heap, hsize, -(cur[k] * nkeys + k))
            continue
        if size == capacity:
            while True:
                top = heap[0]
                v = (-top) % nkeys
                if inside[v] and (-top) // nkeys == cur[v]:
                    break
                top, hsize = _pop(heap, hsize)
            if bypass and nxt[t] >= cur[v]:
                continue  # bypass: the new key is needed last
            top, hsize = _pop(heap, hsize)
            inside[v] = False
            size -= 1
        inside[k] = True
        cur[k] = nxt[t]
        size += 1
        hsize = _push(heap, hsize, -(cur[k] * nkeys + k))
    return hits


@njit
def _lru_touch(nxt, prv, head, k, linked):
    if linked:
        nxt[prv[k]] = nxt[k]
        prv[nxt[k]] = prv[k]
    nxt[k] = nxt[head]
    prv[k] = head
    prv[nxt[head]] = k
    nxt[head] = k


@njit
def _lru_drop(nxt, prv, k):
    nxt[prv[k]] = nxt[k]
    prv[nxt[k]] = prv[k]


@njit
def _lru_warm(initial, capacity, heap, score, inside, in_heap, last, nxt, prv, head, tail, nkeys, base):
    """Load ``initial`` (oldest first, at times ``base + j``) into an empty recency list
    (nothing is in the heap yet, so ``_admit`` evicts the least recently used); returns
    the resident count."""
    size = 0
    for j in range(initial.shape[0]):
        k = initial[j]
        if inside[k]:
            _reuse(k, base + j, in_heap, last, nxt, prv, head)
        else:
            size = _admit(k, base + j, size, capacity, heap, 0, score, inside, in_heap, last, nxt, prv, head, tail,
                          nkeys)[0]
    return size


@njit
def _recency_state(nkeys):
    """Empty residency flags, last-use times and a recency list with sentinels
    ``head = nkeys`` and ``tail = nkeys + 1``: (inside, in_heap, last, nxt, prv)."""
    inside = np.zeros(nkeys, dtype=np.bool_)
    in_heap = np.zeros(nkeys, dtype=np.bool_)
    last = np.zeros(nkeys, dtype=np.int64)
    nxt = np.full(nkeys + 2, -1, dtype=np.int64)
    prv = np.full(nkeys + 2, -1, dtype=np.int64)
    nxt[nkeys] = nkeys + 1
    prv[nkeys + 1] = nkeys
    return inside, in_heap, last, nxt, prv


@njit
def _age_out(before, heap, hsize, score, in_heap, last, nxt, prv, head, tail, nkeys):
    """Residents last used before ``before`` leave the recency list for the heap
    (entries ``score * nkeys + key``); returns the heap size."""
    while prv[tail] != head and last[prv[tail]] < before:
        u = prv[tail]
        _lru_drop(nxt, prv, u)
        in_heap[u] = True
        hsize = _push(heap, hsize, score[u] * nkeys + u)
    return hsize


@njit
def _reuse(k, t, in_heap, last, nxt, prv, head):
    """A hit on resident ``k`` at time ``t``: back to the front of the recency list
    (a heap entry it had goes stale)."""
    if in_heap[k]:
        in_heap[k] = False
        _lru_touch(nxt, prv, head, k, False)
    else:
        _lru_touch(nxt, prv, head, k, True)
    last[k] = t


@njit
def _admit(k, t, size, capacity, heap, hsize, score, inside, in_heap, last, nxt, prv, head, tail, nkeys):
    """Insert missed key ``k`` at time ``t``; when full, evict the lowest current
    (score, key) among aged-out residents in the heap (entries whose score has
    changed since they were pushed are stale and skipped), else the least
    recently used.  Returns (size, hsize)."""
    if size == capacity:
        v = -1
        while hsize > 0:
            top, hsize = _pop(heap, hsize)
            u = top % nkeys
            if inside[u] and in_heap[u] and top // nkeys == score[u]:
                v = u
                break
        if v >= 0:
            in_heap[v] = False
        else:
            v = prv[tail]
            _lru_drop(nxt, prv, v)
        inside[v] = False
        size -= 1
    inside[k] = True
    size += 1
    _lru_touch(nxt, prv, head, k, False)
    last[k] = t
    return size, hsize


@njit
def hot_recent_hits(keys, capacity, initial, heat, window, nkeys):
    # evict the coldest (lowest ``heat``) resident not used in the last ``window``
    # accesses; if every resident is that recent, the least recently used leaves.
    # Warm keys count as used long ago, in their warm order.  That is recent-freq
    # with a fixed score (no run counts: unit 0; its horizon then changes nothing).
    return recent_freq_hits(keys, capacity, initial, heat, window, 0, 0, nkeys)


@njit
def recent_freq_hits(keys, capacity, initial, prior, window, horizon, unit, nkeys):
    # hot-recent with a moving heat: score[k] = prior[k] + unit * (runs of k that
    # started in the last ``horizon`` accesses).  A run starts at an access whose key
    # was not a resident read in the last ``window`` accesses.  Residents read in the
    # last ``window`` accesses stay; among the others the lowest (score, key) leaves;
    # if all are that recent, the least recently used.  Heap entries are
    # ``score * nkeys + key``; one is stale once its key left the heap or its score moved.
    n = keys.shape[0]
    m = initial.shape[0]
    hits = np.zeros(n, dtype=np.bool_)
    if capacity <= 0:
        return hits
    inside, in_heap, last, nxt, prv = _recency_state(nkeys)
    score = prior.copy()
    head = nkeys
    tail = nkeys + 1
    heap = np.empty(m + 2 * n + 1, dtype=np.int64)
    hsize = 0
    ev_t = np.empty(n, dtype=np.int64)  # run starts, oldest first
    ev_k = np.empty(n, dtype=np.int64)
    ev_head = 0
    ev_tail = 0
    base = -(window + m + 2)
    size = _lru_warm(initial, capacity, heap, score, inside, in_heap, last, nxt, prv, head, tail, nkeys, base)
    for t in range(n):
        # runs older than the horizon stop counting
        while ev_head < ev_tail and ev_t[ev_head] < t - horizon:
            u = ev_k[ev_head]
            ev_head += 1
            score[u] -= unit
            if in_heap[u]:
                hsize = _push(heap, hsize, score[u] * nkeys + u)
        hsize = _age_out(t - window, heap, hsize, score, in_heap, last, nxt, prv, head, tail, nkeys)
        k = keys[t]
        if not (inside[k] and not in_heap[k]):
            score[k] += unit
            ev_t[ev_tail] = t
            ev_k[ev_tail] = k
            ev_tail += 1
        if inside[k]:
            hits[t] = True
            _reuse(k, t, in_heap, last, nxt, prv, head)
            continue
        size, hsize = _admit(k, t, size, capacity, heap, hsize, score, inside, in_heap, last, nxt, prv, head, tail,
                             nkeys)
    return hits
