/** The errors the client raises: both carry only what the server said, never request data. */

/** The server refused a request (a 4xx other than 408/425/429): a bug at the call site or in the setup. */
export class CombeeAPIError extends Error {
  override readonly name = 'CombeeAPIError';
  constructor(
    /** The HTTP status. */
    readonly status: number,
    /** The problem's `title`. */
    readonly title: string,
    /** The problem's `detail`, when it had one. */
    readonly detail?: string,
  ) {
    super(detail ? `${title}: ${detail} (HTTP ${status})` : `${title} (HTTP ${status})`);
  }
}

/** The server could not be reached (or answered 5xx/408/425/429) and there was no cached text and no fallback. */
export class CombeeUnavailable extends Error {
  override readonly name = 'CombeeUnavailable';
}

/** Answers that mean "try later", not "you are wrong". */
export function isUnavailable(status: number): boolean {
  return status >= 500 || status === 408 || status === 425 || status === 429;
}

/** The server's problem+json as an error. */
export function apiError(status: number, body: string): CombeeAPIError {
  let title = `HTTP ${status}`;
  let detail: string | undefined;
  try {
    const doc: unknown = JSON.parse(body);
    if (doc && typeof doc === 'object') {
      const d = doc as Record<string, unknown>;
      if (typeof d.title === 'string' && d.title) title = d.title;
      if (d.detail != null) detail = String(d.detail);
    }
  } catch {
    // not JSON: the status says enough
  }
  return new CombeeAPIError(status, title, detail);
}
