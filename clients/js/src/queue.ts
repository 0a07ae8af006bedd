// An unbounded async FIFO: what a Session's reader hands one request, and what a Session sends.

export class AsyncQueue<T> implements AsyncIterable<T> {
  private items: T[] = [];
  private waiters: ((r: IteratorResult<T>) => void)[] = [];
  private failure: unknown = undefined;
  private closed = false;

  push(item: T): void {
    if (this.closed) return;
    const w = this.waiters.shift();
    if (w) w({ value: item, done: false });
    else this.items.push(item);
  }

  /** No more items: iteration ends after the queued ones (or throws err, if given). */
  close(err?: unknown): void {
    if (this.closed) return;
    this.closed = true;
    this.failure = err;
    for (const w of this.waiters.splice(0)) {
      if (err === undefined) w({ value: undefined, done: true });
      else w(Promise.reject(err) as never);
    }
  }

  async next(): Promise<IteratorResult<T>> {
    if (this.items.length > 0) return { value: this.items.shift() as T, done: false };
    if (this.closed) {
      if (this.failure !== undefined) throw this.failure;
      return { value: undefined, done: true };
    }
    return new Promise((resolve) => this.waiters.push(resolve));
  }

  async *[Symbol.asyncIterator](): AsyncGenerator<T> {
    for (;;) {
      const r = await this.next();
      if (r.done) return;
      yield r.value;
    }
  }
}
