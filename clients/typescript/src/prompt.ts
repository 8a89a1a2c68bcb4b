/** A prompt as the server serves it, and its `{name}` placeholders. */

/** One arm of an `evaluated` prompt's experiment, when the server served one. */
export interface Arm {
  version: number;
  /** `champion` or `challenger`. */
  role: string;
  /** The experiment: the prompt's name. */
  experiment: string;
}

/** Where a prompt's text came from. */
export type PromptSource = 'server' | 'stale' | 'fallback';

// `{` + letters, digits or `_` + `}`, not part of `{{`: the server's rule.
const PLACEHOLDER = /(?<!\{)\{([A-Za-z0-9_]+)\}/g;

/** The placeholder names of a text, in order of first appearance. */
export function placeholders(text: string): string[] {
  const seen: string[] = [];
  for (const m of text.matchAll(PLACEHOLDER)) {
    const name = m[1]!;
    if (!seen.includes(name)) seen.push(name);
  }
  return seen;
}

/** A placeholder without a value in `compile`. */
export class MissingVariable extends Error {
  override readonly name = 'MissingVariable';
  constructor(readonly missing: string[]) {
    super(`no value for ${missing.map((m) => `{${m}}`).join(', ')}`);
  }
}

export class Prompt {
  constructor(
    readonly name: string,
    /** The rendered text. */
    readonly text: string,
    /** The version; `null` only for a fallback. */
    readonly version: number | null,
    /** The label asked for (`undefined`: the server's `production`). */
    readonly label: string | undefined,
    /** The labels on this version. */
    readonly labels: readonly string[],
    readonly arm: Arm | null,
    readonly source: PromptSource,
    readonly contentHash: string | null,
    readonly subject: string | undefined,
  ) {}

  /** The placeholder names in the text. */
  get variables(): string[] {
    return placeholders(this.text);
  }

  /** The text with each `{name}` replaced; throws `MissingVariable` naming every placeholder without a value. */
  compile(vars: Record<string, unknown> = {}): string {
    const missing = this.variables.filter((v) => !(v in vars));
    if (missing.length) throw new MissingVariable(missing);
    return this.text.replace(PLACEHOLDER, (_, name: string) => String(vars[name]));
  }

  /** The same prompt from another source. */
  withSource(source: PromptSource): Prompt {
    return new Prompt(this.name, this.text, this.version, this.label, this.labels, this.arm, source, this.contentHash, this.subject);
  }
}

/** Reads `GET /v1/prompts/{name}`'s answer; throws when it is no prompt. */
export function parsePrompt(body: string, label: string | undefined, subject: string | undefined): Prompt {
  const doc: unknown = JSON.parse(body);
  if (!doc || typeof doc !== 'object') throw new Error('the answer is not a prompt');
  const d = doc as Record<string, unknown>;
  if (typeof d.text !== 'string' || typeof d.version !== 'number') throw new Error('the answer is not a prompt (no `text` and `version`)');
  const name = typeof d.name === 'string' ? d.name : '';
  let arm: Arm | null = null;
  if (typeof d.arm === 'string') arm = { version: d.version, role: d.arm, experiment: name };
  const labels = Array.isArray(d.labels) ? d.labels.map(String) : [];
  const hash = typeof d.content_hash === 'string' ? d.content_hash : null;
  return new Prompt(name, d.text, d.version, label, labels, arm, 'server', hash, subject);
}
