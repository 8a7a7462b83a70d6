/* Allowed tokens of one DFA state: a preorder walk of the vocabulary's byte trie.
 *
 * Built at first use by trie_walk.py (cc -O2 -shared) and called through ctypes; the
 * numpy walk in trie_walk.py computes the same mask where no C compiler is present.
 *
 * trans:  int32 [n_states * n_classes], trans[s * n_classes + cls[b]] = next state after
 *         byte b (bytes no state tells apart share a class); `dead` absorbs.
 * Trie nodes in preorder (the root is implicit), one packed record each: the byte, the
 * depth (>= 1), `skip` = the first node after this node's subtree, and `tok` = the token
 * whose bytes end here, or `sink` (a scratch slot of `mask`) when none does. Tokens
 * sharing another token's bytes are copied after the walk (dup_tok <- dup_src).
 * A dead transition skips the whole subtree, so a structural state (few live bytes)
 * touches a handful of nodes and a free-text state touches each node once.
 */
#include <stdint.h>

typedef struct {
    int32_t skip;
    int32_t tok;
    uint8_t byte;
    uint8_t depth;
} lm_node;

void lm_trie_mask(const int32_t *trans, int32_t n_classes, const uint8_t *cls,
                  int32_t dead, int32_t start, int32_t n_nodes,
                  const lm_node *nodes, int32_t n_dups, const int32_t *dup_tok,
                  const int32_t *dup_src, uint8_t *mask) {
    int32_t stack[257];
    int32_t i = 0;
    stack[0] = start;
    while (i < n_nodes) {
        const lm_node nd = nodes[i];
        int32_t s = trans[(int64_t)stack[nd.depth - 1] * n_classes + cls[nd.byte]];
        if (s == dead) {
            i = nd.skip;
            continue;
        }
        stack[nd.depth] = s;
        mask[nd.tok] = 1;
        i++;
    }
    for (int32_t k = 0; k < n_dups; k++)
        mask[dup_tok[k]] = mask[dup_src[k]];
}
