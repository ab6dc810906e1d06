//! Waiting for several futures at once.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Resolves once every future in `futures` has, to their outputs in order.
/// Each is polled again only when the whole is woken: a handful of I/Os
/// of one request, so polling the pending ones on each wake-up is cheap.
pub fn join_all<F: Future>(futures: Vec<F>) -> JoinAll<F> {
    JoinAll {
        futures: futures.into_iter().map(|f| Some(Box::pin(f))).collect(),
        outputs: Vec::new(),
    }
}

pub struct JoinAll<F: Future> {
    futures: Vec<Option<Pin<Box<F>>>>,
    outputs: Vec<Option<F::Output>>,
}

impl<F: Future> Unpin for JoinAll<F> {}

impl<F: Future> Future for JoinAll<F> {
    type Output = Vec<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        if this.outputs.is_empty() {
            this.outputs = (0..this.futures.len()).map(|_| None).collect();
        }
        let mut pending = false;
        for (slot, output) in this.futures.iter_mut().zip(this.outputs.iter_mut()) {
            if let Some(future) = slot {
                match future.as_mut().poll(cx) {
                    Poll::Ready(out) => {
                        *output = Some(out);
                        *slot = None;
                    }
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            return Poll::Pending;
        }
        let outputs = std::mem::take(&mut this.outputs);
        Poll::Ready(
            outputs
                .into_iter()
                .map(|o| o.expect("every future finished"))
                .collect(),
        )
    }
}

/// The output of whichever of two futures finishes first.
pub enum Either<A, B> {
    Left(A),
    Right(B),
}

/// Resolves with the first of `a` and `b` to finish; the other is dropped
/// (a ring operation it started completes unseen: the reactor keeps its
/// buffers until then).
pub fn first_of<A: Future, B: Future>(a: A, b: B) -> FirstOf<A, B> {
    FirstOf {
        a: Box::pin(a),
        b: Box::pin(b),
    }
}

pub struct FirstOf<A: Future, B: Future> {
    a: Pin<Box<A>>,
    b: Pin<Box<B>>,
}

impl<A: Future, B: Future> Future for FirstOf<A, B> {
    type Output = Either<A::Output, B::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if let Poll::Ready(a) = self.a.as_mut().poll(cx) {
            return Poll::Ready(Either::Left(a));
        }
        if let Poll::Ready(b) = self.b.as_mut().poll(cx) {
            return Poll::Ready(Either::Right(b));
        }
        Poll::Pending
    }
}
