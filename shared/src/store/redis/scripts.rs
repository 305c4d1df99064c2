//! The Lua scripts that make each step of a job atomic on Redis — commit
//! (first commit wins), fail, lease, start, publish, fail the job, follow,
//! reduce — with lease times from Redis's own clock (`TIME`). The
//! in-process store ([`crate::store::local`]) mirrors each step by step.

use deadpool_redis::redis;

/// Commits a group of items of one job (`ARGV[4..]`, six per item: seq,
/// rows settled, stats JSON, rows rejected, histogram JSON
/// `counts[column][bin]`, lease field — empty for an item started without
/// the start script and never leased, which has neither a lease to drop nor
/// an earlier failure to forget). An item wins when its seq was not done
/// yet (first commit wins, per item): for a job whose `done_bits` is 1, one
/// `BITFIELD … SET u1` on the bitmap `KEYS[8]` tests and sets every item of
/// the group at once (a seq twice in the group: the second finds the bit the
/// first set); for an older job, one `SMISMEMBER` and one `SADD` on the set
/// `KEYS[1]`. Only the winners' counters, stats and histograms
/// are added, and their earlier failures forgotten. The winners'
/// histograms are summed into the committer's (`ARGV[3]`) running
/// histogram of the job, one field of `KEYS[5]` read and written once per
/// group whatever the output's width (readers sum the fields: one per
/// worker that ever committed to the job). Whatever wins, drops the
/// committers' leases (a done item needs none, and [`lease_script`] writes
/// none for it again) and adds the committer's work since its last count
/// to the work counters (`KEYS[7]`): `ARGV[1]` model rows to
/// `rows_computed`, `ARGV[2]` items it started without the start script to
/// `deliveries`. Nothing is committed to a cancelled job (its part files,
/// published already, are committed when the job is run again), nor to a
/// job whose record Redis lost (restarted empty): the coordinator's rebuild
/// commits its part files, and a commit meanwhile would go to a done set
/// the restored record no longer names. Returns 1
/// or 0 per item, in order. No command runs for nothing: a counter that
/// does not change is not written.
pub const COMMIT_SCRIPT: &str = r#"
local seqs, leases, hists = {}, {}, {}
for i = 4, #ARGV, 6 do
  seqs[#seqs + 1] = ARGV[i]
  if ARGV[i + 5] ~= '' then
    leases[#leases + 1] = ARGV[i + 5]
  end
  -- Decoded before anything is written: a script stopped by an error keeps
  -- what it wrote.
  if ARGV[i + 4] ~= '[]' then
    hists[#seqs] = cjson.decode(ARGV[i + 4])
  end
end
if tonumber(ARGV[1]) > 0 then
  redis.call('HINCRBY', KEYS[7], 'rows_computed', ARGV[1])
end
if tonumber(ARGV[2]) > 0 then
  redis.call('HINCRBY', KEYS[7], 'deliveries', ARGV[2])
end
if #leases > 0 then
  redis.call('HDEL', KEYS[6], unpack(leases))
end
local won = {}
local job = redis.call('HMGET', KEYS[2], 'status', 'done_bits')
if not job[1] or job[1] == 'cancelled' then
  for n = 1, #seqs do
    won[n] = 0
  end
  return won
end
local bits = job[2] == '1'
local was
if bits then
  local ops = {}
  for n = 1, #seqs do
    ops[#ops + 1] = 'SET'
    ops[#ops + 1] = 'u1'
    ops[#ops + 1] = '#' .. seqs[n]
    ops[#ops + 1] = 1
  end
  was = redis.call('BITFIELD', KEYS[8], unpack(ops))
else
  was = redis.call('SMISMEMBER', KEYS[1], unpack(seqs))
end
local items, rows, rejected = 0, 0, 0
local taken, added, forget, stats, summed = {}, {}, {}, {}, {}
for n = 1, #seqs do
  local i = 4 + (n - 1) * 6
  local seq = ARGV[i]
  if was[n] == 0 and not taken[seq] then
    taken[seq] = true
    won[n] = 1
    items = items + 1
    rows = rows + tonumber(ARGV[i + 1])
    rejected = rejected + tonumber(ARGV[i + 3])
    added[#added + 1] = seq
    stats[#stats + 1] = seq
    stats[#stats + 1] = ARGV[i + 2]
    if ARGV[i + 5] ~= '' then
      forget[#forget + 1] = seq
    end
    if hists[n] then
      summed[#summed + 1] = hists[n]
    end
  else
    won[n] = 0
  end
end
if items > 0 then
  if not bits then
    redis.call('SADD', KEYS[1], unpack(added))
  end
  redis.call('HINCRBY', KEYS[2], 'items_done', items)
  redis.call('HINCRBY', KEYS[2], 'rows_done', rows)
  if rejected > 0 then
    redis.call('HINCRBY', KEYS[2], 'rows_rejected', rejected)
  end
  redis.call('HSET', KEYS[3], unpack(stats))
  if #forget > 0 then
    redis.call('HDEL', KEYS[4], unpack(forget))
  end
end
if #summed > 0 then
  local acc = {}
  local mine = redis.call('HGET', KEYS[5], ARGV[3])
  if mine then
    acc = cjson.decode(mine)
  end
  local filled = false
  for _, h in ipairs(summed) do
    for c = 1, #h do
      local col = acc[c]
      if type(col) ~= 'table' then
        col = {}
        acc[c] = col
      end
      for b = 1, #h[c] do
        col[b] = (col[b] or 0) + h[c][b]
        if h[c][b] > 0 then
          filled = true
        end
      end
    end
  end
  if filled then
    redis.call('HSET', KEYS[5], ARGV[3], cjson.encode(acc))
  end
end
return won
"#;

/// Lua: Redis's clock in ms.
const NOW_LUA: &str = "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n";

/// Lua: `is_done(done_bits, set, bitmap, seq)`, whether item `seq` is
/// committed — its bit in the bitmap key `bitmap` when the job record's
/// `done_bits` is `'1'`, else its membership of the set key `set` (a job
/// from before the bitmap). The one done check of the start, lease and
/// fail scripts.
const IS_DONE_LUA: &str = r#"
local function is_done(done_bits, set, bitmap, seq)
  if done_bits == '1' then
    return redis.call('GETBIT', bitmap, seq) == 1
  end
  return redis.call('SISMEMBER', set, seq) == 1
end
"#;

/// Writes a lease unless the item is already done (`KEYS[1]`, or the bit in
/// `KEYS[4]` for a job whose `done_bits` is 1) or its job cancelled
/// (`KEYS[3]`, the job hash), its `heartbeat_ms` set to Redis's clock — and,
/// for the first write of an item started without a lease (`started_ms`
/// 0), its `started_ms` that clock less `ARGV[4]`, how long the worker has
/// held the item. Returns 1 if written.
pub fn lease_script() -> String {
    format!(
        "{NOW_LUA}{IS_DONE_LUA}{}",
        r#"
local job = redis.call('HMGET', KEYS[3], 'status', 'done_bits')
if is_done(job[2], KEYS[1], KEYS[4], ARGV[1]) or job[1] == 'cancelled' then
  return 0
end
local lease = cjson.decode(ARGV[3])
lease['heartbeat_ms'] = now
if (tonumber(lease['started_ms']) or 0) == 0 then
  lease['started_ms'] = math.max(now - (tonumber(ARGV[4]) or 0), 1)
end
redis.call('HSET', KEYS[2], ARGV[2], cjson.encode(lease))
return 1
"#
    )
}

/// Starts holding an item in one round trip, after checking the message
/// against the job record (`ARGV[4..]`: model digest, output folder, pool,
/// model path, and `ARGV[8]` `1` when the broker returned the delivery).
/// Writes nothing unless the answer is `started` or `crashed`, but for
/// crashes: other workers' leases on the item that are stale — neither
/// the lease nor its holder's beat in `KEYS[8]` younger than its ttl — (their worker
/// died holding it; a lease of the same worker id written by another
/// process — `boot` — counts as another worker's) are dropped, each
/// counted as a crash in `KEYS[7]` — unless the lease says its worker was
/// `stopping` (draining after SIGTERM: stopped from outside, not by the item).
/// Then: `crashed` (with the count and the dead workers) once the count
/// reaches the job's `max_crashes` (0: never); `held` (with the ms until
/// the lease goes stale) when the broker returned the delivery and another
/// worker's lease is live — it may have died a moment ago, and its crash is
/// counted before the item runs again; else `started`: the lease (times from
/// Redis's clock), the delivery count, and the crashes so far.
pub fn start_script() -> String {
    format!(
        "{NOW_LUA}{IS_DONE_LUA}{}",
        r#"
local job = redis.call('HMGET', KEYS[5], 'status', 'model_sha256', 'output_dir', 'pool', 'items_total', 'model', 'done_bits', 'max_crashes')
if not job[1] then
  return {'unknown'}
end
local checks = {{'pool', job[4], ARGV[6]}, {'model', job[6], ARGV[7]}, {'model_sha256', job[2], ARGV[4]}, {'output_dir', job[3], ARGV[5]}}
for _, c in ipairs(checks) do
  if c[2] ~= c[3] then
    return {'mismatch', c[1], tostring(c[2] or '')}
  end
end
if tonumber(ARGV[1]) >= (tonumber(job[5]) or 0) then
  return {'mismatch', 'items_total', tostring(job[5] or '')}
end
if is_done(job[7], KEYS[1], KEYS[6], ARGV[1]) then
  return {'done'}
end
if job[1] == 'failed' or job[1] == 'cancelled' then
  return {'job_failed'}
end
if redis.call('HEXISTS', KEYS[4], ARGV[1]) == 1 then
  return {'failed'}
end
if job[1] ~= 'planning' and job[1] ~= 'running' then
  return {'not_running', job[1]}
end
local max = tonumber(job[8]) or 2
local crashes = tonumber(redis.call('HGET', KEYS[7], ARGV[1])) or 0
local lease = cjson.decode(ARGV[3])
local dead, wait = {}, 0
local cursor = '0'
repeat
  local page = redis.call('HSCAN', KEYS[2], cursor, 'MATCH', ARGV[1] .. '@*', 'COUNT', 256)
  cursor = page[1]
  for i = 1, #page[2], 2 do
    local field = page[2][i]
    local other = cjson.decode(page[2][i + 1])
    -- Our own lease, written by this very process, is not a crash; one a
    -- restarted worker of the same id left is.
    if field ~= ARGV[2] or tostring(other['boot'] or '') ~= tostring(lease['boot'] or '') then
      local beat = tonumber(other['heartbeat_ms']) or 0
      if beat + (tonumber(other['ttl_ms']) or 0) < now then
        -- Written once; its worker's beat on the job keeps it live.
        local holder = tostring(other['worker']) .. '/' .. tostring(other['boot'] or '')
        beat = math.max(beat, tonumber(redis.call('HGET', KEYS[8], holder)) or 0)
      end
      local left = beat + (tonumber(other['ttl_ms']) or 0) - now
      if left < 0 then
        redis.call('HDEL', KEYS[2], field)
        -- A worker stopped from outside while it drained is no crash.
        if other['stopping'] ~= true then
          crashes = redis.call('HINCRBY', KEYS[7], ARGV[1], 1)
          dead[#dead + 1] = tostring(other['worker'])
        end
      elseif ARGV[8] == '1' then
        wait = math.max(wait, left + 1)
      end
    end
  end
until cursor == '0'
if max > 0 and crashes >= max then
  return {'crashed', tostring(crashes), table.concat(dead, ' ')}
end
if wait > 0 then
  return {'held', tostring(wait)}
end
lease['started_ms'] = now
lease['heartbeat_ms'] = now
redis.call('HSET', KEYS[2], ARGV[2], cjson.encode(lease))
redis.call('HINCRBY', KEYS[3], 'deliveries', 1)
return {'started', tostring(now), tostring(crashes)}
"#
    )
}

/// A worker's beat on one or more jobs: for each `KEYS[k]` (a job's
/// beats), the count of its fields, then the fields — `<worker>/<boot>`,
/// which keeps every lease of that holder on the job live, and
/// `<worker>/<boot>+queued`, which says it holds work of the job waiting —
/// each set to Redis's clock, one `HSET` per job, one clock read for all.
pub fn beat_script() -> String {
    format!(
        "{NOW_LUA}{}",
        r#"
local a = 1
for k = 1, #KEYS do
  local n = tonumber(ARGV[a])
  a = a + 1
  local args = {}
  for i = 1, n do
    args[#args + 1] = ARGV[a]
    args[#args + 1] = now
    a = a + 1
  end
  if n > 0 then
    redis.call('HSET', KEYS[k], unpack(args))
  end
end
return 1
"#
    )
}

/// Drops the stale leases `ARGV[1..]` (`<seq>@<worker>`) of unsettled items
/// from `KEYS[1]`, counting one crash of the item in `KEYS[2]` for each
/// lease this call dropped (one another caller dropped first is not
/// counted again; nor is one whose worker was `stopping`). Returns
/// `seq, crashes` pairs, one per field.
pub const CRASH_SCRIPT: &str = r#"
local out = {}
for i = 1, #ARGV do
  local seq = string.match(ARGV[i], '^(%d+)@')
  if seq then
    local n
    local held = redis.call('HGET', KEYS[1], ARGV[i])
    local stopping = held and cjson.decode(held)['stopping'] == true
    if redis.call('HDEL', KEYS[1], ARGV[i]) == 1 and not stopping then
      n = redis.call('HINCRBY', KEYS[2], seq, 1)
    else
      n = tonumber(redis.call('HGET', KEYS[2], seq)) or 0
    end
    out[#out + 1] = seq
    out[#out + 1] = n
  end
end
return out
"#;

/// Marks a job published: `published_ms` and `items_published`, and the
/// status `running` — unless a worker failed it meanwhile (nobody can run it).
pub const PUBLISHED_SCRIPT: &str = r#"
redis.call('HSET', KEYS[1], 'published_ms', ARGV[1], 'items_published', ARGV[2])
if redis.call('HGET', KEYS[1], 'status') == 'planning' then
  redis.call('HSET', KEYS[1], 'status', 'running')
end
return 1
"#;

/// Marks a running job failed (class `cancelled`: cancelled) with why, unless it is finished or failed
/// already. Returns 1 if this call failed it.
pub const FAIL_JOB_SCRIPT: &str = r#"
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'planning' and status ~= 'running' then
  return 0
end
local to = 'failed'
if ARGV[1] == 'cancelled' then
  to = 'cancelled'
end
redis.call('HSET', KEYS[1], 'status', to, 'failed_class', ARGV[1], 'failed_reason', ARGV[2])
return 1
"#;

/// Takes or keeps the follower lease (`KEYS[1]`) for `ARGV[1]` for
/// `ARGV[2]` ms. Returns 1 if `ARGV[1]` holds it.
pub const FOLLOW_SCRIPT: &str = r#"
local v = redis.call('GET', KEYS[1])
if v and v ~= ARGV[1] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"#;

/// Gives the follower lease (`KEYS[1]`) up if `ARGV[1]` holds it.
pub const UNFOLLOW_SCRIPT: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
end
return 1
"#;

/// Claims the reduce step of the job (`KEYS[1]`, fields `reducer` and
/// `reducer_ms`) for `ARGV[1]`: refused once the job is reduced (a final
/// status with `finished_ms`), or while another's claim is younger than
/// `ARGV[2]` ms. Returns 1 if claimed.
pub fn reduce_script() -> String {
    format!(
        "{NOW_LUA}{}",
        r#"
local j = redis.call('HMGET', KEYS[1], 'status', 'finished_ms', 'reducer', 'reducer_ms')
if not j[1] then
  return 0
end
if j[1] ~= 'planning' and j[1] ~= 'running' and (tonumber(j[2]) or 0) > 0 then
  return 0
end
if j[3] and j[3] ~= '' and j[3] ~= ARGV[1] and now - (tonumber(j[4]) or 0) < tonumber(ARGV[2]) then
  return 0
end
redis.call('HSET', KEYS[1], 'reducer', ARGV[1], 'reducer_ms', now)
return 1
"#
    )
}

/// Records a failure unless the item is already done (a late failure of a
/// duplicate delivery must not mark a committed item failed; the done set
/// `KEYS[1]`, or the bitmap `KEYS[4]` when the job hash `KEYS[3]` says
/// `done_bits`). Returns 1 if recorded.
pub fn fail_script() -> String {
    format!(
        "{IS_DONE_LUA}{}",
        r#"
if is_done(redis.call('HGET', KEYS[3], 'done_bits'), KEYS[1], KEYS[4], ARGV[1]) then
  return 0
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
"#
    )
}

/// Notes job `ARGV[1]` retired now (Redis's clock) in the pool's retired
/// jobs (`KEYS[1]`, a sorted set by ms).
pub fn note_retired_script() -> String {
    format!(
        "{NOW_LUA}{}",
        r#"
redis.call('ZADD', KEYS[1], now, ARGV[1])
return 1
"#
    )
}

/// Claims up to `ARGV[2]` jobs retired at least `ARGV[1]` ms ago (Redis's
/// clock) in the pool's retired jobs (`KEYS[1]`): their times set to now,
/// so that no other sweep takes them within the grace. Returns now, then
/// the jobs.
pub fn take_retired_script() -> String {
    format!(
        "{NOW_LUA}{}",
        r#"
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[1]), 'LIMIT', 0, tonumber(ARGV[2]))
for _, job in ipairs(due) do
  redis.call('ZADD', KEYS[1], now, job)
end
table.insert(due, 1, tostring(now))
return due
"#
    )
}

/// Drops job `ARGV[1]` from the pool's retired jobs (`KEYS[1]`) if its time
/// is still `ARGV[2]` (the claim of the sweep that deleted its queue).
pub const DROP_RETIRED_SCRIPT: &str = r#"
if redis.call('ZSCORE', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('ZREM', KEYS[1], ARGV[1])
end
return 1
"#;

/// The scripts, loaded once per store (each is sent by its digest, and
/// loaded again only when Redis does not know it).
#[derive(Clone)]
pub(super) struct Scripts {
    pub(super) commit: redis::Script,
    pub(super) fail: redis::Script,
    pub(super) lease: redis::Script,
    pub(super) start: redis::Script,
    pub(super) fail_job: redis::Script,
    pub(super) published: redis::Script,
    pub(super) crash: redis::Script,
    pub(super) beat: redis::Script,
    pub(super) note_retired: redis::Script,
    pub(super) take_retired: redis::Script,
    pub(super) drop_retired: redis::Script,
}

impl Scripts {
    /// Every script.
    pub(super) fn new() -> Self {
        Self {
            commit: redis::Script::new(COMMIT_SCRIPT),
            fail: redis::Script::new(&fail_script()),
            lease: redis::Script::new(&lease_script()),
            start: redis::Script::new(&start_script()),
            fail_job: redis::Script::new(FAIL_JOB_SCRIPT),
            published: redis::Script::new(PUBLISHED_SCRIPT),
            crash: redis::Script::new(CRASH_SCRIPT),
            beat: redis::Script::new(&beat_script()),
            note_retired: redis::Script::new(&note_retired_script()),
            take_retired: redis::Script::new(&take_retired_script()),
            drop_retired: redis::Script::new(DROP_RETIRED_SCRIPT),
        }
    }
}
