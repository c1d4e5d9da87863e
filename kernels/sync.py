"""Claim-and-complete phases: the threads of one parallel region share a step's work without barriers.

A phase is a row of an int64 array (its own cache line): [claimed, completed, ...]. A thread claims a
phase's pieces from `claimed` (fetch_add), runs each, counts it in `completed` (a release), and then
waits (an acquire load) until every piece is complete. A waiting thread only ever waits on pieces a
running thread claimed, so the region finishes however many of its iterations really run at once: a
threading layer that runs them one after another (or a team smaller than asked) only loses the
parallelism, never deadlocks, and each piece's result does not depend on which thread ran it.
"""

from __future__ import annotations

import platform
import sys

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .simd import fetch_add

PHASE_WORDS = 8  # int64 per phase: one 64-byte line, so waiting on one phase never shares another's line
SPINS_BEFORE_YIELD = 2000  # ~50-100 us of pause loops, then sched_yield: the owner may be off its core
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")
_YIELD = sys.platform != "win32"


@intrinsic
def load_acquire(typingctx, addr):
    """The int64 at addr, loaded with acquire ordering (what the completer wrote before it is visible)."""

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.load_atomic(ptr, "acquire", 8)

    return types.int64(types.int64), codegen


@intrinsic
def add_release(typingctx, addr, value):
    """Atomically add value to the int64 at addr with release ordering (this thread's writes first)."""

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", ptr, args[1], "release")

    return types.int64(types.int64, types.int64), codegen


@intrinsic
def spin_pause(typingctx):
    """x86 `pause` inside a spin loop (lets the sibling hyper-thread run, saves power); nothing elsewhere."""

    def codegen(context, builder, signature, args):
        if _X86:
            void = ir.FunctionType(ir.VoidType(), [])
            builder.call(builder.module.declare_intrinsic("llvm.x86.sse2.pause", fnty=void), [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def yield_cpu(typingctx):
    """sched_yield(): a waiter gives its core to the thread it waits for (or another process)."""

    def codegen(context, builder, signature, args):
        if _YIELD:
            fn = cgutils_function(builder.module, "sched_yield", ir.FunctionType(ir.IntType(32), []))
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


def cgutils_function(module: ir.Module, name: str, fnty: ir.FunctionType) -> ir.Function:
    fn = module.globals.get(name)
    return fn if fn is not None else ir.Function(module, fnty, name)


@njit(cache=True, inline="always")
def _word(sync, phase, i):
    return sync.ctypes.data + (phase * PHASE_WORDS + i) * 8


@njit(cache=True, inline="always")
def claim(sync, phase) -> int:
    """The index of the next unclaimed piece of `phase` (>= its piece count: none left)."""
    return fetch_add(_word(sync, phase, 0), 1)


@njit(cache=True, inline="always")
def complete(sync, phase) -> None:
    """One piece of `phase` is done (its results written before this)."""
    add_release(_word(sync, phase, 1), 1)


@njit(cache=True)
def wait_complete(sync, phase, pieces) -> None:
    """Until all `pieces` of `phase` are complete."""
    addr, spins = _word(sync, phase, 1), 0
    while load_acquire(addr) < pieces:
        spins += 1
        if spins < SPINS_BEFORE_YIELD:
            spin_pause()
        else:
            yield_cpu()


@njit(cache=True, inline="always")
def serial_first(sync, phase) -> bool:
    """Whether this thread claimed the one piece of a serial phase (then it runs it and calls complete)."""
    return claim(sync, phase) == 0
