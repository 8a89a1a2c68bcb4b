# shellcheck shell=bash
# Starts and stops a private, throw-away PostgreSQL server for tests and
# benchmarks: initdb + pg_ctl in a temp dir, on a free loopback port.
# Source it, call start_private_postgres, and it exports DATABASE_URL.
# `start_private_postgres --no-fsync` is for the test suite: the server is
# thrown away at the end, so it skips flushing to disk (fsync, synchronous
# commit, full-page writes); every test database and commit is then cheap.
# Benchmarks start it without, as a deployment would run.
# `start_private_postgres --statements` (durable) also preloads
# pg_stat_statements when the installation has it, so a benchmark can say
# which statements took Postgres's time.

_pg_as_owner() {
  if [ "$(id -u)" = 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

_pg_bin() {
  if command -v "$1" >/dev/null 2>&1; then
    command -v "$1"
  else
    local found
    found=$(ls -d /usr/lib/postgresql/*/bin/"$1" 2>/dev/null | sort -V | tail -n 1)
    [ -n "$found" ] || { echo "scripts: PostgreSQL's $1 was not found (install postgresql)" >&2; return 1; }
    echo "$found"
  fi
}

start_private_postgres() {
  local initdb pg_ctl port options="" libdir
  initdb=$(_pg_bin initdb) && pg_ctl=$(_pg_bin pg_ctl) || return 1
  if [ "${1:-}" = --no-fsync ]; then
    options="-c fsync=off -c synchronous_commit=off -c full_page_writes=off"
  elif [ "${1:-}" = --statements ]; then
    libdir="$(dirname "$(readlink -f "$initdb")")/../lib"
    if [ -e "$libdir/pg_stat_statements.so" ]; then
      options="-c shared_preload_libraries=pg_stat_statements"
    fi
  fi
  COMBEE_PG_DIR=$(mktemp -d /tmp/combee-pg.XXXXXX)
  chmod 755 "$COMBEE_PG_DIR"
  if [ "$(id -u)" = 0 ]; then chown postgres "$COMBEE_PG_DIR"; fi
  port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  _pg_as_owner "$initdb" -D "$COMBEE_PG_DIR/data" -U postgres --auth=trust -E UTF8 >"$COMBEE_PG_DIR/initdb.log" 2>&1 \
    || { cat "$COMBEE_PG_DIR/initdb.log" >&2; return 1; }
  _pg_as_owner "$pg_ctl" -D "$COMBEE_PG_DIR/data" -l "$COMBEE_PG_DIR/server.log" -w -t 60 \
    -o "-p $port -k $COMBEE_PG_DIR -c listen_addresses=127.0.0.1 -c max_connections=400 -c shared_buffers=256MB $options" \
    start >/dev/null || { cat "$COMBEE_PG_DIR/server.log" >&2; return 1; }
  export COMBEE_PG_DIR
  export DATABASE_URL="postgres://postgres@127.0.0.1:$port/postgres"
  echo "scripts: private PostgreSQL on port $port ($COMBEE_PG_DIR)" >&2
}

stop_private_postgres() {
  [ -n "${COMBEE_PG_DIR:-}" ] || return 0
  _pg_as_owner "$(_pg_bin pg_ctl)" -D "$COMBEE_PG_DIR/data" -m fast -w stop >/dev/null 2>&1 || true
  rm -rf "$COMBEE_PG_DIR"
}
