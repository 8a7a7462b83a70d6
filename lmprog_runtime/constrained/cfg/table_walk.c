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
 * Returns 0 when the walk is done, or stops at node *at: 1 its transition is UNKNOWN,
 * 2 it is PYTHON, 3 the liveness of the state it reaches is unknown. The caller fills
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

int32_t cfg_table_walk(const int32_t *trans, const uint8_t *lives, const lm_node *nodes,
                       int32_t n_nodes, int32_t sink, int32_t *stack, int32_t *at, uint8_t *mask) {
    int32_t i = *at;
    while (i < n_nodes) {
        const lm_node nd = nodes[i];
        int32_t s = trans[(int64_t)stack[nd.depth - 1] * 256 + nd.byte];
        if (s < 0) {
            if (s == CFG_DEAD) {
                i = nd.skip;
                continue;
            }
            *at = i;
            return s == CFG_UNKNOWN ? 1 : 2;
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
