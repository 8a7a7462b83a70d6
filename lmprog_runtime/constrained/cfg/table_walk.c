/* The token mask of a parse state: the vocabulary's byte trie walked against a lazily
 * filled transition table of interned matcher states (cfg/table.py).
 *
 * Built at first use by table.py (cc -O2 -shared, native.Kernel), called through ctypes.
 * trans:  int32 [n_states * 256]: trans[s * 256 + b] = the interned state after byte b,
 *         or DEAD (-2: no continuation, the subtree is skipped), UNKNOWN (-1: not derived
 *         yet) or PYTHON (-3: the next state reads the output text; Python walks that
 *         subtree).
 * lives:  uint8 [n_states]: 0 unknown, 1 a token may end in this state (one byte of
 *         lookahead has a continuation), 2 it may not, 3 it depends on the output text
 *         (the caller decides at each such node).
 * nodes:  the trie in preorder (the root is implicit), as in trie_walk.c.
 * stack:  int32 [257]: stack[d] = the state after the first d bytes of the current path;
 *         stack[0] is the walk's start state. Kept by the caller between calls.
 * path:   uint8 [257]: path[d-1] = the byte of the current node at depth d (the caller
 *         writes it for a node it steps itself).
 * A PYTHON transition on the quote closing a key is looked up in `keys` first; an UNKNOWN
 * one of a string-body state is read off its lexeme's first state (`lx`) when it can be.
 * Returns 0 when the walk is done, or stops at node *at: 1 its transition is UNKNOWN (the
 * bytes to derive, its own and its later siblings', are listed in pend),
 * 2 it is PYTHON (or an unregistered key close), 3 the liveness of the state it
 * reaches is unknown. The caller fills
 * the table (or walks the subtree) and calls again with *at (or the subtree's end).
 */
#include <stdint.h>

typedef struct {
    int32_t skip;
    int32_t tok;
    uint8_t byte;
    uint8_t depth;
} lm_node;

#define CFG_UNKNOWN (-1)
#define CFG_DEAD (-2)
#define CFG_PYTHON (-3)
#define CFG_HEAD_ESCAPED (-2)

/* Registered key closes (keycloses.py): table [cap x 4] int64 entries (hash, p << 32 | id,
 * text offset in pool, text length; length -1 = empty slot), cap a power of two;
 * inside [n_states]: 1 where the state is inside a key whose text is FREE (plain mode);
 * head: the walk root's key text (UTF-8), head_len -1 when the root is not inside a key
 * in plain mode, CFG_HEAD_ESCAPED when it is right after a backslash (the path's first byte
 * is then an escaped character, a quote that opens nothing);
 * generic [n_states]: the state after the close of any key not registered (a key of
 * additionalProperties: the same state for every such text, its key EXTRA), or UNKNOWN;
 * the keys that are not such (declared properties, keys already seen) are registered,
 * as UNKNOWN where Python has not derived them yet. */
typedef struct {
    const int64_t *table;
    int64_t cap;
    const uint8_t *pool;
    const uint8_t *inside;
    const uint8_t *head;
    int64_t head_len;
    const int32_t *generic;
} cfg_keys;

/* FNV-1a over the state id's 4 bytes, then the text (keycloses.py computes the same). */
static uint64_t key_hash(int32_t state, const uint8_t *text, int32_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (int k = 0; k < 4; k++) {
        h ^= (uint8_t)((uint32_t)state >> (8 * k));
        h *= 1099511628211ULL;
    }
    for (int32_t k = 0; k < n; k++) {
        h ^= text[k];
        h *= 1099511628211ULL;
    }
    return h;
}

/* The state after the quote closing the key that state `p` is inside, read off the walked
 * path (path[0..d-2], the key's text after the last quote on it, or after `head`, the
 * root key's text, when there is none): the registered id, DEAD, the state's generic
 * close when the text is not registered, or UNKNOWN when it cannot be read here (an escape
 * on the path) or nothing is known. */
static int32_t key_close(const cfg_keys *keys, int32_t p, const uint8_t *path, int32_t d) {
    uint8_t text[512];
    int32_t q = d - 2, n = 0;
    while (q >= 0 && path[q] != 0x22) {
        if (path[q] == 0x5C)
            return CFG_UNKNOWN;
        q--;
    }
    if (q == 0 && keys->head_len == CFG_HEAD_ESCAPED)
        return CFG_UNKNOWN; /* the path's first quote is the escaped character of the root's `\` */
    if (q < 0) {
        if (keys->head_len < 0 || keys->head_len + d - 1 > (int32_t)sizeof(text))
            return CFG_UNKNOWN;
        for (int32_t k = 0; k < keys->head_len; k++)
            text[n++] = keys->head[k];
    }
    for (int32_t k = q + 1; k <= d - 2; k++)
        text[n++] = path[k];
    uint64_t h = key_hash(p, text, n);
    for (int64_t slot = (int64_t)(h & (uint64_t)(keys->cap - 1));; slot = (slot + 1) & (keys->cap - 1)) {
        const int64_t *e = keys->table + 4 * slot;
        if (e[3] < 0)
            return keys->generic[p];
        if ((uint64_t)e[0] == h && e[3] == n) {
            const uint8_t *got = keys->pool + e[2];
            int32_t k = 0;
            while (k < n && got[k] == text[k])
                k++;
            if (k == n && (int32_t)(e[1] >> 32) == p)
                return (int32_t)(e[1] & 0xFFFFFFFF);
        }
    }
}

/* String-body lexeme states (table.py `StateTable`), so that a string in a new context
 * takes its inside steps here, not in Python: a state s whose one stack is a plain string
 * body (no enum) has rep[s] (the first state interned with the same top frame), below[s]
 * (an id of the stack under that frame) and kind[s] (1: its quote ends the string, 2: inside
 * an escape or a UTF-8 sequence, nothing ends it; 0: not such a state). A step of s on a
 * byte that does not end it is that of rep[s] with s's stack below: the state with top
 * frame rep[trans[rep * 256 + b]] over below[s], found in `map` (open addressing, key
 * rep << 32 | below, -1 empty) or made here (id n, while n < cap; src[id] = the state its
 * top frame is read from, for Python to build the tuple when it needs it).
 * Whitespace between JSON tokens is a lexeme too (kind 3: a ws byte may follow, 4: none
 * may): a state whose one stack tops a V / O / A frame with a nullable whitespace state
 * has below[s] = the id of its context (the frame less its whitespace, the stack under
 * it) and rep[s] = the first state with the same whitespace state (any context), so a ws
 * byte's step is rep's, in s's context; a non-ws byte's step does not read the whitespace
 * state: it is that of ctxrep[below[s]], the context's first such state. */
typedef struct {
    int32_t *rep;
    int32_t *below;
    uint8_t *kind;
    int32_t *src;
    uint8_t *inside;
    uint8_t *lives;
    int64_t *map;
    int64_t map_cap;
    int32_t *n;
    int32_t cap;
    int32_t *ctxrep;
} cfg_lex;

static int is_ws(uint8_t b) {
    return b == 0x20 || b == 0x09 || b == 0x0A || b == 0x0D;
}

static uint64_t lex_slot(int64_t key, int64_t cap) {
    return (((uint64_t)key * 0x9E3779B97F4A7C15ULL) >> 29) & (uint64_t)(cap - 1);
}

/* The step of lexeme state p on byte b read off its rep, or UNKNOWN. */
static int32_t lex_step(int32_t *trans, const cfg_lex *lx, int32_t p, uint8_t b) {
    uint8_t k = lx->kind[p];
    int32_t r = lx->rep[p];
    if (k >= 3 && !is_ws(b)) { /* (the context's row: the whitespace state is not read) */
        int32_t c = lx->ctxrep[lx->below[p]];
        return c < 0 || c == p ? CFG_UNKNOWN : trans[(int64_t)c * 256 + b];
    }
    if (k == 0 || (k == 1 && b == 0x22) || r < 0 || r == p)
        return CFG_UNKNOWN;
    int32_t t = trans[(int64_t)r * 256 + b];
    if (t == CFG_DEAD)
        return CFG_DEAD;
    if (t < 0 || lx->kind[t] == 0 || lx->below[t] != lx->below[r])
        return CFG_UNKNOWN; /* (not derived on the rep yet, or not a step inside the string) */
    int64_t key = ((int64_t)lx->rep[t] << 32) | (int64_t)lx->below[p];
    uint64_t slot = lex_slot(key, lx->map_cap);
    while (lx->map[2 * slot] != -1) {
        if (lx->map[2 * slot] == key)
            return (int32_t)lx->map[2 * slot + 1];
        slot = (slot + 1) & (uint64_t)(lx->map_cap - 1);
    }
    int32_t s = *lx->n;
    if (s >= lx->cap)
        return CFG_UNKNOWN;
    *lx->n = s + 1;
    lx->rep[s] = lx->rep[t];
    lx->below[s] = lx->below[p];
    lx->kind[s] = lx->kind[t];
    lx->src[s] = t;
    lx->inside[s] = lx->inside[t];
    lx->lives[s] = lx->kind[t] == 4 ? 0 : 1; /* (a plain string body takes any byte, whitespace
                                                  a ws byte: a token may end in it) */
    lx->map[2 * slot] = key;
    lx->map[2 * slot + 1] = s;
    return s;
}

/* At a stop on node i (state p, UNKNOWN): pend[0] = how many bytes follow in pend[1..], those
 * of node i and of its later siblings (the walk meets them next) that Python must derive. */
static void pending(const int32_t *trans, const cfg_lex *lx, const lm_node *nodes, int32_t n_nodes,
                    int32_t i, int32_t p, int32_t *pend) {
    int32_t n = 0, depth = nodes[i].depth;
    int32_t r = lx->kind[p] && lx->rep[p] != p ? lx->rep[p] : -1;
    int32_t c = lx->kind[p] >= 3 ? lx->ctxrep[lx->below[p]] : -1;
    for (int32_t j = i; j < n_nodes && nodes[j].depth == depth; j = nodes[j].skip) {
        uint8_t b = nodes[j].byte;
        int32_t q = lx->kind[p] >= 3 && !is_ws(b) ? (c != p ? c : -1) : r;
        if (trans[(int64_t)p * 256 + b] == CFG_UNKNOWN &&
            (j == i || q < 0 || trans[(int64_t)q * 256 + b] == CFG_UNKNOWN))
            pend[1 + n++] = b;
    }
    pend[0] = n;
}

int32_t cfg_table_walk(int32_t *trans, const uint8_t *lives, const lm_node *nodes,
                       int32_t n_nodes, int32_t sink, int32_t *stack, int32_t *at, uint8_t *mask,
                       const cfg_keys *keys, uint8_t *path, const cfg_lex *lx, int32_t *pend) {
    int32_t i = *at;
    while (i < n_nodes) {
        const lm_node nd = nodes[i];
        int32_t p = stack[nd.depth - 1];
        int32_t s = trans[(int64_t)p * 256 + nd.byte];
        path[nd.depth - 1] = nd.byte;
        if (s == CFG_UNKNOWN) {
            s = lex_step(trans, lx, p, nd.byte);
            if (s != CFG_UNKNOWN)
                trans[(int64_t)p * 256 + nd.byte] = s;
        }
        if (s == CFG_PYTHON && nd.byte == 0x22 && keys->inside[p])
            s = key_close(keys, p, path, nd.depth);
        if (s < 0) {
            if (s == CFG_DEAD) {
                i = nd.skip;
                continue;
            }
            *at = i;
            if (s == CFG_UNKNOWN && trans[(int64_t)p * 256 + nd.byte] == CFG_UNKNOWN) {
                pending(trans, lx, nodes, n_nodes, i, p, pend);
                return 1;
            }
            return 2;
        }
        stack[nd.depth] = s;
        if (nd.tok != sink) {
            uint8_t l = lives[s];
            if (l != 1 && l != 2) {
                *at = i;
                return 3;
            }
            if (l == 1)
                mask[nd.tok] = 1;
        }
        i++;
    }
    *at = i;
    return 0;
}

/* The whole-character plain tokens a string pattern state survives (mask.py _regex_alive):
 * token r's characters are idx[off[r] .. off[r + 1]) (at most width), indices of distinct code points
 * whose classes are cmap[...], stepped through the pattern's class table
 * trans[state * n_classes + class] (int64, -1 not derived yet) from `start`; alive[r] = 1
 * when no step reaches `dead`. The tokens are sorted by their characters and lcp[r] is the
 * length of the prefix token r shares with token r - 1: a token resumes at that depth from
 * the states its predecessor reached, and one whose shared prefix covers the character its
 * predecessor stopped at stops there too (a walk over the tokens' character trie). A step
 * not derived yet (-1) is written to missing once (state, class pairs, at most max_missing;
 * marked -2 in trans, which the caller fills before the next run; the tokens meeting it are
 * left unset): returns how many were written (0: alive is complete). end[r] is the state
 * token r ends in where it is alive (`dead` elsewhere): what the pattern still needs after it
 * (mask.py _plain_need). */
int32_t cfg_class_walk(const int32_t *idx, const int64_t *off, const int32_t *lcp, int32_t n, int32_t width,
                       const int32_t *cmap, int64_t *trans, int32_t n_classes, int64_t start, int64_t dead,
                       uint8_t *alive, int64_t *end, int64_t *missing, int32_t max_missing) {
    int32_t m = 0, stop = 0; /* stop: the depth token r - 1's walk ended at */
    int64_t st[width + 1]; /* st[k]: the state after the first k characters of the current token */
    st[0] = start;
    for (int32_t r = 0; r < n; r++) {
        int32_t k = lcp[r], l = (int32_t)(off[r + 1] - off[r]);
        if (k > stop) { /* it shares the character its predecessor stopped at */
            alive[r] = 0;
            end[r] = dead;
            continue;
        }
        int64_t s = st[k];
        const int32_t *row = idx + off[r];
        for (; k < l; k++) {
            int32_t c = cmap[row[k]];
            int64_t t = trans[s * n_classes + c];
            if (t < 0) {
                if (t == -1 && m < max_missing) { /* listed once: marked -2 until Python fills it */
                    trans[s * n_classes + c] = -2;
                    missing[2 * m] = s;
                    missing[2 * m + 1] = c;
                    m++;
                }
                break;
            }
            if (t == dead)
                break;
            s = t;
            st[k + 1] = s;
        }
        stop = k;
        alive[r] = k == l;
        end[r] = k == l ? s : dead;
    }
    return m;
}
