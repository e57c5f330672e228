-- A SQL workload for the SQLite shell (benchmarks and churn tests): bulk insert, index
-- build, aggregates, a self-join, an update and a pattern scan on an in-memory database.
CREATE TABLE t(id INTEGER PRIMARY KEY, k INTEGER, v TEXT);
WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 300000)
INSERT INTO t(k, v) SELECT (x * 7919) % 10007, printf('row-%d-%x', x, x * 2654435761 % 4294967296) FROM c;
CREATE INDEX tk ON t(k);
SELECT count(*), sum(k), max(length(v)) FROM t;
SELECT k, count(*) AS n FROM t GROUP BY k ORDER BY n DESC, k LIMIT 5;
SELECT sum(a.k * b.k) % 1000003 FROM t a JOIN t b ON a.k = b.k AND a.id < b.id WHERE a.id % 40 = 0;
UPDATE t SET v = upper(v) WHERE k % 3 = 0;
SELECT count(*) FROM t WHERE v GLOB 'ROW-*';
SELECT group_concat(id, ',') FROM (SELECT id FROM t WHERE k = 4242 ORDER BY id LIMIT 10);
