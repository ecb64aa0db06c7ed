/*
 * extree core: what the B+tree's own files share (extree-btree.c,
 * extree-btree-edit.c, extree-btree-drop.c) and nobody else calls
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#ifndef EXTREE_BTREE_INT_H
#define EXTREE_BTREE_INT_H

#include "extree-int.h"

/* extree-btree.c: the spine */

/* Exclusive key bound of the node at @level of the path */
uint64_t extree_bt_node_end(ExtreeTree *tree, ExtreePath *p, int level);
/* What child @slot of @parent (whose own key bound is @parent_end) must be */
void extree_bt_child_expect(ExtreeTree *tree, const ExtreeNode *parent,
                            int slot, uint64_t parent_end,
                            ExtreeNodeExpect *e);
/* Pinned child @slot of @parent (whose own key bound is @parent_end) */
int extree_bt_child(Extree *t, ExtreeTree *tree, ExtreeNode *parent,
                    int slot, uint64_t parent_end, ExtreeNode **out);
/*
 * @n leaves the tree while what it refers to stays (copied, or moved into
 * a sibling): unshared, its location is freed and the references move
 * with the contents; shared, the contents gain a reference each and @n
 * loses one (spec: Sharing, 1)
 */
int extree_bt_release(Extree *t, ExtreeTree *tree, ExtreeNode *n);
/* Make the node at @level of the path writable in this transaction */
int extree_bt_cow(Extree *t, ExtreeTree *tree, ExtreePath *p, int level);
/*
 * Descend to the leaf for @dkey; slots[0] = first item with key >= @key;
 * with @cow every node on the path is made writable
 */
int extree_bt_search(Extree *t, ExtreeTree *tree, uint64_t dkey,
                     uint64_t key, ExtreePath *p, bool cow,
                     bool count_descent);

/* extree-btree-edit.c */

/* Unlink a node from the tree: its location is freed */
int extree_bt_free_node(Extree *t, ExtreeNode *n);

#endif
