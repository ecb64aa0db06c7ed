/*
 * extree core: what the bitmap files share (extree-bitmap.c, the bits in
 * memory; extree-bitmap-io.c, their commit and open) and nobody else calls
 *
 * Copyright (c) 2026 The extree authors
 *
 * SPDX-License-Identifier: GPL-2.0-or-later
 */

#ifndef EXTREE_BITMAP_INT_H
#define EXTREE_BITMAP_INT_H

#include "extree-int.h"

#define BH_OFF(f) offsetof(ExtreeDiskBitmapHeader, f)
#define BE_OFF(f) offsetof(ExtreeDiskBitmapEntry, f)
#define BC_OFF(f) offsetof(ExtreeDiskBitmapChunk, f)

/* A guest range this transaction changed, [start, end) */
typedef struct ExtreeBitmapMark {
    uint64_t start, end;
} ExtreeBitmapMark;

/* ExtreeBitmap.chunk_state: what this transaction did to a chunk */
enum { CHUNK_CLEAN, CHUNK_CHANGED, CHUNK_MOVED };

/* Granules of a disk of @size bytes, chunks holding @ngran granules */
uint64_t extree_bm_ngranules(uint64_t size, uint32_t gran_bits);
uint64_t extree_bm_nchunks_for(uint64_t ngran, uint32_t block_size);
/* Would a bitmap of @nchunks chunks take more memory than we allow? */
bool extree_bm_too_big(const Extree *t, uint64_t nchunks);
/* Directory bytes of one entry; of them all with @extra more, at @size */
uint64_t extree_bm_entry_bytes(size_t name_len, uint64_t nchunks);
uint64_t extree_bm_dir_bytes(Extree *t, uint64_t size, uint64_t extra);
ExtreeBitmap *extree_bm_new(Extree *t, const char *name, uint32_t gran_bits,
                            bool enabled);
void extree_bm_free(ExtreeBitmap *bm);
/* Is chunk @c all zero (it then has no block)? */
bool extree_bm_chunk_zero(Extree *t, const ExtreeBitmap *bm, uint64_t c);
uint64_t extree_bm_popcount(const uint8_t *p, size_t len);
/* Does chunk @c differ from its committed copy? */
bool extree_bm_chunk_differs(Extree *t, const ExtreeBitmap *bm, uint64_t c);
/* Chunk @c of @bm loses its block (freed at commit), if it has one */
int extree_bm_chunk_release(Extree *t, ExtreeBitmap *bm, uint64_t c);
/* Bitmap @i leaves the list (kept for the in-place rule until commit) */
void extree_bm_drop(Extree *t, guint i);
/* The directory is written again at the next commit */
void extree_bm_changed(Extree *t);

#endif
