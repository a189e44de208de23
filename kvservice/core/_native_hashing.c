/* vLLM's default block hash, sha256(pickle.dumps((parent, tokens, None), protocol=5)),
 * and its sha256_cbor, sha256(cbor2.dumps((parent, tokens, None), canonical=True)), for
 * a chain of plain blocks in one call.
 *
 * block_hashing.BlockHasher hashes a request's new full blocks one by one: a tuple per
 * block, a Pickler per block, a hashlib object per block. Here the pickle bytes of a
 * block are written straight into a buffer (the opcodes CPython's _pickle.c emits for
 * that one shape: a short bytes object, a tuple of ints, None; or CBOR's items, as
 * cbor2 writes them) and hashed with
 * OpenSSL's SHA-256, the implementation hashlib uses. Anything outside that shape (a
 * token that is not an exact int in the int32 range, token ids in neither a list nor
 * an array of 4-byte ints, a parent of 256 bytes or more) returns None, and the
 * caller hashes the chain the Python way: the bytes hashed are pickle's (cbor2's),
 * always.
 * tests/core/test_native_hashing.py holds both to that.
 *
 * Built with the compiled core (setup.py), into kvservice/_compiled; the sources
 * (KVSERVICE_PURE_PYTHON=1) never import it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
/* SHA256_Init/Update/Final: deprecated since OpenSSL 3.0 in favour of EVP, still
 * exported (3.0 here); they hash into a context on the stack, with nothing looked up
 * or allocated per digest. */
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/sha.h>
#include <string.h>

/* pickle's opcodes for this shape (Lib/pickletools.py documents each). */
#define OP_PROTO 0x80
#define OP_FRAME 0x95
#define OP_SHORT_BINBYTES 'C'
#define OP_MEMOIZE 0x94
#define OP_MARK '('
#define OP_BININT 'J'
#define OP_BININT1 'K'
#define OP_BININT2 'M'
#define OP_TUPLE 't'
#define OP_TUPLE1 0x85
#define OP_NONE 'N'
#define OP_TUPLE3 0x87
#define OP_STOP '.'
#define PROTOCOL 5
#define FRAME_HEADER 9 /* FRAME and its 8-byte length */
/* _pickle.c's FRAME_SIZE_TARGET: past it pickle splits the frame, which this writer
 * does not; a block whose bound (max_block_size) could reach it goes to Python: from
 * 13,096 tokens a block with a 32-byte parent. */
#define FRAME_SIZE_TARGET (64 * 1024)
#define STACK_BUFFER 1024

/* The most bytes one block takes in either form: pickle's head is the longer (PROTO,
 * FRAME, the parent's opcode and MEMOIZE against CBOR's heads of at most 5 bytes), a
 * token takes at most 5 bytes in both, and pickle's fixed opcodes close it. */
static Py_ssize_t
max_block_size(Py_ssize_t parent_len, Py_ssize_t block_size)
{
    return 2 + FRAME_HEADER + 2 + parent_len + 1 + 5 + 5 * block_size + 1 + 1 + 3 + 1;
}

static int
is_int32(long value)
{
    return value >= -0x7fffffffL - 1 && value <= 0x7fffffffL;
}

/* save_long's binary forms: the fewest bytes that hold the value, little-endian. */
static unsigned char *
write_int(unsigned char *out, long value)
{
    uint32_t bits = (uint32_t)value;
    if (bits & 0xffff0000u) {
        *out++ = OP_BININT;
        for (int i = 0; i < 4; i++)
            *out++ = (unsigned char)(bits >> (8 * i));
    }
    else if (bits & 0xff00u) {
        *out++ = OP_BININT2;
        *out++ = (unsigned char)bits;
        *out++ = (unsigned char)(bits >> 8);
    }
    else {
        *out++ = OP_BININT1;
        *out++ = (unsigned char)bits;
    }
    return out;
}

/* A request's token ids: a list's items, or a packed array's 4-byte ids (the server
 * keeps a prompt in the array it came in; pickling its slice as a tuple makes the same
 * Python ints the list would hold). */
typedef struct {
    PyObject *list;     /* a list, or NULL */
    PyObject **items;   /* its items, read once no Python code can run (chain) */
    const unsigned char *packed;
    Py_ssize_t count;
    int is_signed;
} Tokens;

/* Token i as a long; 0, or -1 when pickle would write it in a form other than BININT*
 * (a bool or an int subclass, a value outside the int32 range: LONG1, never a token). */
static int
token_at(const Tokens *tokens, Py_ssize_t i, long *value)
{
    if (tokens->packed != NULL) {
        uint32_t bits;
        memcpy(&bits, tokens->packed + 4 * i, 4);
        *value = tokens->is_signed ? (long)(int32_t)bits : (long)bits;
        return is_int32(*value) ? 0 : -1;
    }
    PyObject *token = tokens->items[i];
    int overflow = 0;
    if (!PyLong_CheckExact(token))
        return -1;
    *value = PyLong_AsLongAndOverflow(token, &overflow);
    return overflow || !is_int32(*value) ? -1 : 0;
}

/* Writes one block's bytes into buf: their length, or -1 when token_at declines. */
typedef Py_ssize_t (*BlockWriter)(unsigned char *buf, const unsigned char *parent,
                                  Py_ssize_t parent_len, const Tokens *tokens,
                                  Py_ssize_t first, Py_ssize_t n);

/* The pickle of (parent, tuple(tokens[first:first + n]), None), as pickle.dumps writes
 * it with protocol 5; its length, or -1 when token_at declines a token (no error set). */
static Py_ssize_t
write_block(unsigned char *buf, const unsigned char *parent, Py_ssize_t parent_len,
            const Tokens *tokens, Py_ssize_t first, Py_ssize_t n)
{
    unsigned char *out = buf + 2 + FRAME_HEADER;
    *out++ = OP_SHORT_BINBYTES;
    *out++ = (unsigned char)parent_len;
    memcpy(out, parent, (size_t)parent_len);
    out += parent_len;
    *out++ = OP_MEMOIZE;
    if (n > 3)
        *out++ = OP_MARK;
    for (Py_ssize_t i = first; i < first + n; i++) {
        long value;
        if (token_at(tokens, i, &value) < 0)
            return -1;
        out = write_int(out, value);
    }
    /* TUPLE1, TUPLE2 and TUPLE3 follow each other, as the tuple sizes they build. */
    *out++ = n > 3 ? OP_TUPLE : (unsigned char)(OP_TUPLE1 + n - 1);
    *out++ = OP_MEMOIZE;
    *out++ = OP_NONE;
    *out++ = OP_TUPLE3;
    *out++ = OP_MEMOIZE;
    *out++ = OP_STOP;

    Py_ssize_t size = out - buf;
    uint64_t frame = (uint64_t)(size - 2 - FRAME_HEADER);
    buf[0] = OP_PROTO;
    buf[1] = PROTOCOL;
    buf[2] = OP_FRAME;
    for (int i = 0; i < 8; i++)
        buf[3 + i] = (unsigned char)(frame >> (8 * i));
    return size;
}

/* A CBOR head: major type and argument, in the fewest bytes (RFC 8949 4.2.1; cbor2
 * writes every int and length so, canonical or not). */
static unsigned char *
write_cbor_head(unsigned char *out, unsigned char major, uint32_t argument)
{
    if (argument < 24) {
        *out++ = (unsigned char)(major | argument);
    }
    else if (argument < 0x100u) {
        *out++ = (unsigned char)(major | 24);
        *out++ = (unsigned char)argument;
    }
    else if (argument < 0x10000u) {
        *out++ = (unsigned char)(major | 25);
        *out++ = (unsigned char)(argument >> 8);
        *out++ = (unsigned char)argument;
    }
    else {
        *out++ = (unsigned char)(major | 26);
        for (int i = 3; i >= 0; i--)
            *out++ = (unsigned char)(argument >> (8 * i));
    }
    return out;
}

#define CBOR_UNSIGNED 0x00
#define CBOR_NEGATIVE 0x20
#define CBOR_BYTES 0x40
#define CBOR_ARRAY 0x80
#define CBOR_NULL 0xf6

/* cbor2.dumps((parent, tuple(tokens[first:first + n]), None), canonical=True): an
 * array of three, the parent's byte string, the tokens' array, null. */
static Py_ssize_t
write_cbor_block(unsigned char *buf, const unsigned char *parent, Py_ssize_t parent_len,
                 const Tokens *tokens, Py_ssize_t first, Py_ssize_t n)
{
    unsigned char *out = write_cbor_head(buf, CBOR_ARRAY, 3);
    out = write_cbor_head(out, CBOR_BYTES, (uint32_t)parent_len);
    memcpy(out, parent, (size_t)parent_len);
    out += parent_len;
    out = write_cbor_head(out, CBOR_ARRAY, (uint32_t)n);
    for (Py_ssize_t i = first; i < first + n; i++) {
        long value;
        if (token_at(tokens, i, &value) < 0)
            return -1;
        out = value >= 0 ? write_cbor_head(out, CBOR_UNSIGNED, (uint32_t)value)
                         : write_cbor_head(out, CBOR_NEGATIVE, (uint32_t)(-1 - value));
    }
    *out++ = CBOR_NULL;
    return out - buf;
}

/* Hashes num_blocks blocks of tokens[start:], chained from parent; a new list, None
 * when a block falls outside the shape written here, or NULL with an error set. */
static PyObject *
chain(BlockWriter write, const unsigned char *parent, Py_ssize_t parent_len, Tokens *tokens,
      Py_ssize_t start, Py_ssize_t num_blocks, Py_ssize_t block_size, unsigned char *buf)
{
    PyObject *hashes = PyList_New(num_blocks);
    if (hashes == NULL)
        return NULL;
    /* A list is read after PyList_New, which may collect garbage and so run a finalizer
     * that changes it; nothing below runs Python code. (An array cannot change while
     * its buffer is held.) */
    if (tokens->list != NULL) {
        tokens->items = ((PyListObject *)tokens->list)->ob_item;
        tokens->count = PyList_GET_SIZE(tokens->list);
    }
    if (num_blocks > (tokens->count - start) / block_size) {
        Py_DECREF(hashes);
        return PyErr_Format(PyExc_ValueError,
                            "%zd blocks of %zd tokens from %zd do not fit in %zd tokens",
                            num_blocks, block_size, start, tokens->count);
    }
    unsigned char digest[SHA256_DIGEST_LENGTH];
    for (Py_ssize_t b = 0; b < num_blocks; b++) {
        Py_ssize_t size =
            write(buf, parent, parent_len, tokens, start + b * block_size, block_size);
        if (size < 0) {
            Py_DECREF(hashes);
            Py_RETURN_NONE;
        }
        SHA256_CTX ctx;
        SHA256_Init(&ctx);
        SHA256_Update(&ctx, buf, (size_t)size);
        SHA256_Final(digest, &ctx);
        PyObject *hash = PyBytes_FromStringAndSize((const char *)digest, SHA256_DIGEST_LENGTH);
        if (hash == NULL) {
            Py_DECREF(hashes);
            return NULL;
        }
        PyList_SET_ITEM(hashes, b, hash);
        parent = digest;
        parent_len = SHA256_DIGEST_LENGTH;
    }
    return hashes;
}

/* A buffer of 4-byte ints ("i" or "I", as array.array exports them; "l"/"L" where a C
 * long is 4 bytes); 1 when signed, 0 when not, -1 for any other format. */
static int
packed_signedness(const Py_buffer *view)
{
    const char *format = view->format;
    if (view->itemsize != 4 || view->ndim != 1 || format == NULL)
        return -1;
    if (format[0] == '@' || format[0] == '=')
        format++;
    if (format[1] != '\0')
        return -1;
    if (format[0] == 'i' || format[0] == 'l')
        return 1;
    if (format[0] == 'I' || format[0] == 'L')
        return 0;
    return -1;
}

/* The shared body of both functions: the arguments checked, the tokens found, a
 * buffer for one block, the chain. */
static PyObject *
hash_chain(const char *name, BlockWriter write, Py_ssize_t max_bytes, PyObject *const *args,
           Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "%s takes 5 arguments (%zd given)", name, nargs);
        return NULL;
    }
    PyObject *parent = args[0], *token_ids = args[1];
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    Py_ssize_t num_blocks = PyLong_AsSsize_t(args[3]);
    Py_ssize_t block_size = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyBytes_CheckExact(parent)) {
        PyErr_Format(PyExc_TypeError, "%s: the parent hash must be bytes", name);
        return NULL;
    }
    if (start < 0 || num_blocks < 0 || block_size <= 0) {
        return PyErr_Format(PyExc_ValueError,
                            "%zd blocks of %zd tokens from %zd do not fit in any tokens",
                            num_blocks, block_size, start);
    }
    Py_ssize_t parent_len = PyBytes_GET_SIZE(parent);
    if (parent_len > 255)
        Py_RETURN_NONE; /* pickle's BINBYTES, CBOR's longer head: never a digest */

    Tokens tokens = {NULL, NULL, NULL, 0, 0};
    Py_buffer view = {0};
    int has_view = 0;
    if (PyList_CheckExact(token_ids)) {
        tokens.list = token_ids;
    }
    else if (PyObject_CheckBuffer(token_ids)) {
        if (PyObject_GetBuffer(token_ids, &view, PyBUF_FORMAT | PyBUF_ND) < 0)
            return NULL;
        has_view = 1;
        tokens.packed = view.buf;
        tokens.count = view.len / 4;
        tokens.is_signed = packed_signedness(&view);
        if (tokens.is_signed < 0) {
            PyBuffer_Release(&view);
            Py_RETURN_NONE; /* an array of other ints: Python slices it into a list */
        }
    }
    else {
        Py_RETURN_NONE; /* any other sequence: the same */
    }

    unsigned char stack[STACK_BUFFER];
    unsigned char *buf = stack;
    Py_ssize_t needed = max_block_size(parent_len > SHA256_DIGEST_LENGTH
                                           ? parent_len : SHA256_DIGEST_LENGTH,
                                       block_size);
    if (needed > max_bytes) {
        if (has_view)
            PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    PyObject *hashes = NULL;
    if (needed > STACK_BUFFER && (buf = PyMem_Malloc((size_t)needed)) == NULL) {
        PyErr_NoMemory();
    }
    else {
        hashes = chain(write, (const unsigned char *)PyBytes_AS_STRING(parent), parent_len,
                       &tokens, start, num_blocks, block_size, buf);
    }
    if (buf != stack && buf != NULL)
        PyMem_Free(buf);
    if (has_view)
        PyBuffer_Release(&view);
    return hashes;
}

PyDoc_STRVAR(sha256_pickle_chain_doc,
"sha256_pickle_chain(parent, token_ids, start, num_blocks, block_size, /)\n"
"--\n\n"
"The hashes of num_blocks blocks of token_ids (a list, or an array of 4-byte ints)\n"
"from start, each sha256(pickle.dumps((parent, tuple(tokens), None), protocol=5))\n"
"chained on the one before it, the first on parent; None when token_ids is another\n"
"sequence, a token is not an int in the int32 range, parent is 256 bytes or longer,\n"
"or a block could fill pickle's 64 KiB frame (hash those in Python).");

static PyObject *
sha256_pickle_chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    return hash_chain("sha256_pickle_chain", write_block, FRAME_SIZE_TARGET, args, nargs);
}

PyDoc_STRVAR(sha256_cbor_chain_doc,
"sha256_cbor_chain(parent, token_ids, start, num_blocks, block_size, /)\n"
"--\n\n"
"sha256_pickle_chain with vLLM's sha256_cbor: each block's hash is\n"
"sha256(cbor2.dumps((parent, tuple(tokens), None), canonical=True)).");

static PyObject *
sha256_cbor_chain(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    return hash_chain("sha256_cbor_chain", write_cbor_block, PY_SSIZE_T_MAX, args, nargs);
}

static PyMethodDef methods[] = {
    {"sha256_pickle_chain", (PyCFunction)(void (*)(void))sha256_pickle_chain, METH_FASTCALL,
     sha256_pickle_chain_doc},
    {"sha256_cbor_chain", (PyCFunction)(void (*)(void))sha256_cbor_chain, METH_FASTCALL,
     sha256_cbor_chain_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvservice.core._native_hashing",
    .m_doc = "vLLM's sha256 and sha256_cbor block hash chains, their bytes written in C.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__native_hashing(void)
{
    return PyModuleDef_Init(&module_def);
}
